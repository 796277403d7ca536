"""The model cut into pipeline stages, and the text it trains on."""

from sentinel_node.model.corpus import Corpus, load_corpus
from sentinel_node.model.stage import StageModule, build_stage, layer_range

__all__ = ["Corpus", "StageModule", "build_stage", "layer_range", "load_corpus"]
