"""Built-in adapters for torch objects (Module, Optimizer, LRScheduler).

Until they are registered here, these objects go through the generic
``state_dict()`` / ``load_state_dict()`` adapter in :mod:`.registry`.
"""
