from calutil.fmt import iso


def test_iso():
    assert iso(2024, 3, 7) == "2024-03-07"
