"""Images in: decoding what requests send (images.py) and each vision family's host side
(gemma3.py: config, preprocessing, prompt expansion). The towers run on the GPU (models/siglip.py)."""
