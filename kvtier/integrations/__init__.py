"""Engine connectors on top of the client. ``kvtier.integrations.vllm`` (a vLLM KV connector)
imports vLLM; the engine-free parts it is made of (connector, planner, mover) do not."""
