"""flashdraft: train DFlash speculative-decoding drafters online, with the target inside the job."""

__version__ = "0.1.0"
