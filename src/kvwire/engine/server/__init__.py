"""``kvwire engine``'s server: vLLM's HTTP API (:mod:`.app`, on :mod:`kvwire.http1.server`) in
front of the engine model, its request and response shapes (:mod:`.openai`) and the clock
that steps each DP rank's model and publishes its KV events (:mod:`.runner`), and the
prefill/decode side: the KV side channel between engines and SGLang's bootstrap server
(:mod:`.pd`)."""
