"""Small, offline example models and data used by the demo, the configs and the tests."""
