"""The one error every tokenizer part raises: its own module, below the interface
(base.py), the chat templates (template.py) and how vLLM hands content to them (content.py),
so that each imports it without importing the others."""


class TokenizerError(ValueError):
    """A tokenizer could not be loaded or a chat could not be rendered; the message says
    which path, file or template and what was wrong."""
