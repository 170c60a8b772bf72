"""The RFC #1403 KV indexer API (`kvwire index`, and the same routes inside `kvwire serve`):
Dynamo's and SGLang's routers ask it which engine holds how much of a prompt."""
