"""How a model is spread over devices: stage plans, staged models, pipelines, branches."""
