"""The memory plan: hardware probe, model geometry, and where each part of a model goes."""
