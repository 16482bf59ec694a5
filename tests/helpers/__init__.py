"""What the tests share, one module per job: ``dist`` (real gloo ranks in forked processes, the
environment of launched scripts), ``reference`` (the float64 references of the optimizers),
``char_model`` (the character-level model and its 2-rank fit), ``user_models`` (the zoo of
users' models), ``probe_model`` (a small model for the probe)."""
