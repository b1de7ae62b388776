"""ESFT adapters: the on-disk format (`esft`) and the batched expert map (`expert_map`)."""

from elasticmoe.adapters.esft import AdapterError, EsftAdapter, EsftConfig, ExpertTensors, expert_tensors

__all__ = ["AdapterError", "EsftAdapter", "EsftConfig", "ExpertTensors", "expert_tensors"]
