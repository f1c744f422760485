"""Settings shared by ups-samplers' tests."""

from __future__ import annotations

from hypothesis import settings

# Registered, not loaded: loading would change every other distribution's tests in the same
# pytest session. The property tests apply it with @settings(settings.get_profile(...)).
settings.register_profile("ups-samplers", max_examples=75, deadline=None)
