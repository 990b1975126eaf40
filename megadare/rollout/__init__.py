"""Rollout: the engine protocol, the built-in torch engine and its samplers (SGLang engine, Ray manager and
weight sync follow the same protocol)."""
