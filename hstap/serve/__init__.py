"""Serving: an OpenAI-compatible server over the embedded target (`hstap.serve.hf_server`)."""
