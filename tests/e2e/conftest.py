from tests.stack import live_stack, stack_settings  # noqa: F401
