"""HTTP serving: ``blockspec serve`` (OpenAI-compatible and sglang-native endpoints) on top of
the engine loop. Nothing here touches tensors; importing this package stays cheap (FastAPI and
uvicorn load only when a server is built)."""
