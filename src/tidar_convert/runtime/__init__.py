"""What an export runs: TiDAR decoding (generate.py, the entry point transformers loads from an
export's custom_generate/), the mask layout, drafters, verification and the CPU kernels.

Export copies this folder whole into every export, so its modules import nothing but torch,
transformers (numpy with it) and each other (relatively); tests/test_structure.py holds them to
it. The rest of the toolkit may import from here; nothing here imports the rest of the toolkit.
"""
