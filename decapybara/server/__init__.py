"""Ray Serve wiring: app config (pydantic), the ingress deployment, the Ray engine client."""
