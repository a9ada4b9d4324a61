"""Documents that cross a process boundary, shared by their producer and every consumer:
the engine wire format, the engine statistics file, the ``/health/memory`` report and the
OpenAI error envelope. Imports nothing of ours."""
