"""pdserve's torch-free shared package: the generated wire schemas (`pdserve.v1`), configuration
and CLI flags, environment variables, registry records, the request vocabulary (sampling params,
tokenizer, detokenizer), net helpers and `pd-serve`'s local cluster. It imports nothing else of
this project, so every process (the router included) may import it."""
