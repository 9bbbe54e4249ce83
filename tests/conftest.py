"""Settings for the whole suite."""

from hypothesis import settings

# The property tests check behaviour, not speed: on a shared 2-core machine one example may take
# longer than hypothesis' default deadline of 200 ms without anything being wrong.
settings.register_profile("agentkv", deadline=None)
settings.load_profile("agentkv")
