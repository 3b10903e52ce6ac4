"""What a run says about itself from what is committed: one streaming pass over the markers (`stream`), the
findings and verdict (`validation`), report.json / report.md / PNGs (`files`, `markdown`, `plots`), and
`tokenmill inspect`, which decodes committed samples into their parts (`decode`).
"""
