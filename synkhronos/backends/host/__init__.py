"""This host's processes, cores and GPUs: the ``subprocess`` launcher (``launcher``), the
``cpu`` device (``device``) and GPU discovery (``gpus``)."""
