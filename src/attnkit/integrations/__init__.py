"""Integrations of attnkit with other libraries, one module each, imported only on demand.

The core never imports anything here: ``import attnkit`` needs torch alone. Each module names the
optional extra that brings its library (``pip install 'attnkit[transformers]'``).

- :mod:`attnkit.integrations.transformers`: ``attn_implementation="attnkit"`` for Hugging Face
  transformers models, with masks passed as attnkit's structured masks.
"""
