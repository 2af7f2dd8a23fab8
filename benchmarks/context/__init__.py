"""Context-attribution benchmark on SmolLM2-135M-Instruct: data, ContextCite's protocol, peers, runs."""
