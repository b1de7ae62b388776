"""Coordinator: Ray Serve + FastAPI ingress (OpenAI API, admin API), router, scaler, scale events, launch."""
