"""The application around the library: the ``armor-trl`` command, YAML recipes, the real-model loader, tiny test
models and the studies. The library (everything outside ``armor_trl.app``) never imports it
(tests/test_architecture.py)."""
