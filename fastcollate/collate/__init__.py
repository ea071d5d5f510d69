"""The collate: the contract (``contract``, ``padding``), the batch walk's Python side (``assemble``,
``tree``, ``ids``, ``errors``, ``jagged``) and the column gather (``gather``); csrc/collate/ is its C++."""
