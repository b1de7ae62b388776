"""ElasticMoE core: config, models, layers, engine, adapters, cli."""

from elasticmoe.llm import LLM
from elasticmoe.outputs import RequestOutput
from elasticmoe.sampling_params import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
