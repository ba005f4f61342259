"""Evaluations run through ``blockspec.Engine`` (``blockspec eval ...``)."""
