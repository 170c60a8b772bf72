"""The OpenAI-compatible proxy of `kvwire serve`: each /v1 request is parsed, tokenized,
routed by the routing core and relayed to its engine over the one HTTP client."""
