"""Adapters over the base model: ESFT expert sets (`esft`), LoRA (`lora`) and learned routers over
LoRA adapters (`lora_router`), their slots in the engine, and which kind a directory holds
(`kinds`, importable without torch)."""
