"""The drafter folder that inference engines load (docs/method.md section 7): `codec.py` maps a DrafterConfig and its
weights to config.json and tensor names and back (no files); `writer.py` writes a folder, `reader.py` reads one or a
checkpoint, `serve.py` gives the commands that serve it.
"""
