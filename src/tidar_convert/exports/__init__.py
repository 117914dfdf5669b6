"""Writing a TiDAR export (folder.py: weights, config, runtime code, card, marker) and the
file-safety helpers every writer uses (outputs.py: atomic folders; disk.py: space checks;
marker.py: what an export wrote). Imports runtime/ and models/."""
