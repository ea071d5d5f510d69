"""The collate's planning: the contract (``contract``, ``declaration_rules``, ``native_contract``), the
errors that name a sample (``errors``), ids (``ids``) and the column gather (``gather``); csrc/collate/ is
its C++. fastcollate.assembler puts a plan where ``transfer/`` says."""
