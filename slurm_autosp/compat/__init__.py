"""The private APIs of submitit, torch and DeepSpeed that slurm_autosp relies on, in one place.

Each is a name upstream may rename or remove in any release; tests/test_compat.py checks every
one against the installed versions, so an upgrade that breaks one fails there, by name, rather
than deep inside a job. Code elsewhere uses these instead of the private names.
submitit_api needs no torch; torch_api imports torch._dynamo and inductor; deepspeed_api,
DeepSpeed (the ZeRO-1 engine imports it when it is built).
"""
