"""ElasticMoE core: config, models, layers, engine, adapters, cli."""
