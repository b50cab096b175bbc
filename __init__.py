"""fastanchor: anchored training of vision models with a data-pipeline-centric trainer."""

__version__ = "0.1.0"
