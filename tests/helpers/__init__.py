"""What the tests share and are not tests themselves: datasets that misbehave on purpose (importable by
name, so spawned DataLoader workers and ``python -m fastcollate doctor tests.helpers.audit_datasets:...``
can load them) and running commands in processes of their own."""
