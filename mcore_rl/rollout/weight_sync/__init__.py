"""Weight sync from the trainer to an engine: transports (disk, tensor, nccl), the folder writer, the side group."""
