"""Shared pytest setup: hypothesis profiles.

``ci`` (the default) keeps the suite fast and repeatable (derandomized: the same examples each run, so a
green suite stays green until the code changes); ``dev`` and ``thorough`` draw more, and new, examples.  Pick one with
``HYPOTHESIS_PROFILE=thorough pytest ...``.
"""
import os

from hypothesis import HealthCheck, settings

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much,
                                                     HealthCheck.data_too_large])
settings.register_profile("ci", max_examples=50, derandomize=True, **_common)   # the same examples each run
settings.register_profile("dev", max_examples=200, **_common)
settings.register_profile("thorough", max_examples=1000, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))
