"""From a worker's batch to the device: ``staging`` (the page-locked ring), ``worker_slots`` (DataLoader
workers' shared slots), ``device_loader`` (DeviceLoader), ``transforms`` and ``ops`` (device transforms),
and their helpers; csrc/memory/ and csrc/ops/ are their C++."""
