"""LangChain and LlamaIndex front ends over `kev_engine`: `kev_integrations.langchain` (KevLLM,
ChatKev) and `kev_integrations.llamaindex` (Kev)."""

__all__: list[str] = []
