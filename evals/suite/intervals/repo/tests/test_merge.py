from intervals.merge import merge


class TestMerge:
    def test_empty(self):
        assert merge([]) == []

    def test_overlap(self):
        assert merge([(1, 5), (2, 8)]) == [(1, 8)]

    def test_disjoint(self):
        assert merge([(1, 2), (4, 6)]) == [(1, 2), (4, 6)]
