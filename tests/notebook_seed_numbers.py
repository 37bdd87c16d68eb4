"""What each example notebook must print in its checked cells: the seed notebooks' printed numbers
(copied from the seeds' exports in shared/seeds/, or reused from the seed parity tests) and shapes,
and bounds on what the notebooks add beyond the seeds (a trained model's scores, the difference
between two attention implementations), whose exact digits are not the point.

A notebook cell tagged ``check:NAME`` prints its result; ``test_notebooks.py`` reads the numbers
back from the executed notebook's output and compares them with ``EXPECTED[notebook][NAME]``.
``None`` marks a number the seed did not print (the notebook prints NaN or its own value there).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import seed002_printed
from test_seed_parity import SEED002_CONTEXT, SEED002_SCORES_ROW_2, SEED002_WEIGHTS

# The seeds print 4 decimals and so do the notebooks: half a unit of the last digit each way.
PRINTED_TWICE = 1e-4


@dataclass(frozen=True)
class Numbers:
    """Numbers that must appear, in this order and consecutively, among the printed ones."""

    values: tuple[float | None, ...]
    atol: float = PRINTED_TWICE
    rtol: float = 0.0


@dataclass(frozen=True)
class Lines:
    """Text that must appear in the printed output (shapes, dictionaries, integer tensors)."""

    texts: tuple[str, ...]


@dataclass(frozen=True)
class Bounded:
    """For each ``(label, low, high)``: the first number printed after ``label`` lies in
    ``[low, high]`` (``None``: unbounded on that side)."""

    bounds: tuple[tuple[str, float | None, float | None], ...]


def numbers(*rows, atol: float = PRINTED_TWICE, rtol: float = 0.0) -> Numbers:
    def flat(value):
        if isinstance(value, (list, tuple)):
            for item in value:
                yield from flat(item)
        elif hasattr(value, "tolist"):
            yield from flat(value.tolist())
        else:
            yield value

    return Numbers(tuple(v for row in rows for v in flat(row)), atol, rtol)


def lines(*texts: str) -> Lines:
    return Lines(texts)


def bounded(*bounds: tuple[str, float | None, float | None]) -> Bounded:
    return Bounded(bounds)


INF = math.inf
_ = None

# --- seed 002 (the six tokens), beyond what the parity tests hold -----------------------------
SEED002_ALL_SCORES = [
    [0.9995, 0.9544, 0.9422, 0.4753, 0.4576, 0.6310],
    [0.9544, 1.4950, 1.4754, 0.8434, 0.7070, 1.0865],
    [0.9422, 1.4754, 1.4570, 0.8296, 0.7154, 1.0605],
    [0.4753, 0.8434, 0.8296, 0.4937, 0.3474, 0.6565],
    [0.4576, 0.7070, 0.7154, 0.3474, 0.6654, 0.2935],
    [0.6310, 1.0865, 1.0605, 0.6565, 0.2935, 0.9450]]
SEED002_TRAINABLE_SCORES = [
    [0.9231, 1.3545, 1.3241, 0.7910, 0.4032, 1.1330],
    [1.2705, 1.8524, 1.8111, 1.0795, 0.5577, 1.5440],
    [1.2544, 1.8284, 1.7877, 1.0654, 0.5508, 1.5238],
    [0.6973, 1.0167, 0.9941, 0.5925, 0.3061, 0.8475],
    [0.6114, 0.8819, 0.8626, 0.5121, 0.2707, 0.7307],
    [0.8995, 1.3165, 1.2871, 0.7682, 0.3937, 1.0996]]
SEED002_SPLIT_HEADS_OUTPUT = [[0.3190, 0.4858], [0.2943, 0.3897], [0.2856, 0.3593],
                              [0.2693, 0.3873], [0.2639, 0.3928], [0.2575, 0.4028]]

# --- seed 003 (two heads of 4 over a batch of 2 x 3 tokens) -----------------------------------
SEED003_QUERIES_SPLIT = [
    [[[-0.2101, -0.3526, 0.2313, -0.2076], [0.3132, -0.7180, -0.4983, -0.1015], [0.0373, 0.0739, 0.2784, 0.5304]],
     [[-0.6798, -0.0843, -0.4807, 0.4135], [-0.0967, 0.1530, 0.2631, -0.0825], [0.2237, -0.7869, -0.9946, 0.8966]]],
    [[[0.8011, -0.2928, 0.1292, -0.6189], [0.4967, -0.3740, 0.0132, -0.6353], [0.2963, -0.3409, -0.2049, -0.0806]],
     [[-0.1394, 0.5197, 0.2627, 0.4689], [-0.8985, 0.1501, -0.5515, -0.3980], [0.6988, 0.1840, -0.6014, 0.3676]]]]
SEED003_SCORES = [
    [[[0.0207, -0.0143, -0.0674], [0.1255, 0.1223, -0.1535], [-0.1467, -0.0965, 0.1083]],
     [[0.2201, -0.0801, 0.1437], [-0.0335, 0.0499, 0.0102], [0.2111, -0.2235, -0.0176]]],
    [[[0.5600, -0.8450, 0.1783], [0.6453, -0.6661, 0.2507], [0.2900, -0.3500, 0.1462]],
     [[-0.0637, -0.1002, 0.0466], [-0.2561, -0.1172, 0.1331], [0.1381, -0.4218, -0.4746]]]]
SEED003_MASKED_SCORES = [
    [[[-1e9, -1.4259e-02, -6.7406e-02], [1.2546e-01, -1e9, -1e9], [-1.4671e-01, -9.6459e-02, -1e9]],
     [[-1e9, -8.0123e-02, 1.4368e-01], [-3.3508e-02, -1e9, -1e9], [2.1106e-01, -2.2352e-01, -1e9]]],
    [[[5.6001e-01, -1e9, 1.7827e-01], [-1e9, -1e9, -1e9], [2.8996e-01, -1e9, -1e9]],
     [[-6.3654e-02, -1e9, 4.6578e-02], [-1e9, -1e9, -1e9], [1.3805e-01, -1e9, -1e9]]]]
SEED003_WEIGHTS = [
    [[[0.0000, 0.5133, 0.4867], [1.0000, 0.0000, 0.0000], [0.4874, 0.5126, 0.0000]],
     [[0.0000, 0.4443, 0.5557], [1.0000, 0.0000, 0.0000], [0.6070, 0.3930, 0.0000]]],
    [[[0.5943, 0.0000, 0.4057], [0.3333, 0.3333, 0.3333], [1.0000, 0.0000, 0.0000]],
     [[0.4725, 0.0000, 0.5275], [0.3333, 0.3333, 0.3333], [1.0000, 0.0000, 0.0000]]]]
# The heads of batch 0 (the seed's values are cut short in its export: head 1's first query reads
# a value it never printed).
SEED003_HEADS_BATCH_0 = [
    [[0.0406, -0.2769, 0.6934, 0.3928], [0.5662, 1.2474, 0.6110, 0.3846], [0.4764, 0.7553, 0.3367, 0.5807]],
    [[_, _, _, _], [0.7495, 0.0327, -0.5575, -0.4441], [0.7607, 0.0516, -0.5495, -0.4652]]]
# attnkit's rule where a query may attend to no key (batch 1, query 1): zeros, where the seed's
# -1e9 fill gave a uniform 1/3; the other queries of batch 1 read values the export does not show.
EMPTY_ROW_BATCH_1 = [[_, _, _, _], [0.0, 0.0, 0.0, 0.0], [_, _, _, _]] * 2

EXPECTED: dict[str, dict[str, Numbers | Lines | Bounded]] = {
    "000_scaled_dot_product": {
        # Printed to 5 significant digits, down to 1e-22: compared relatively.
        "one-query": numbers([1.0000e01, 2.1216e-21, 2.0000e00], [1.9287e-22, 1.0000e00, 1.9287e-22, 1.9287e-22],
                             atol=0, rtol=2e-4),
        "three-queries": numbers([0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 0.5, 0.5], [0.5, 0.5, 0.0, 0.0], atol=0),
        "multi-head-shapes": lines("torch.Size([1, 3, 4])", "torch.Size([1, 2, 3, 3])"),
    },
    "001_one_word_attends": {
        "vocabulary": lines("{'a': 0, 'brown': 1, 'dog': 2, 'fox': 3, 'jumps': 4, 'lazy': 5, 'over': 6, 'quick': 7, "
                            "'the': 8}", "tensor([8, 7, 1, 3, 4, 6, 0, 5, 2])"),
        "embeddings": numbers(
            [-8.8338e-01, -4.1891e-01, -8.0483e-01, 5.6561e-01, 6.1036e-01, 4.6688e-01, 1.9507e+00, -1.0631e+00,
             -7.7326e-02, 1.1640e-01, -5.9399e-01, -1.2439e+00, -1.0209e-01, -1.0335e+00, -3.1264e-01, 2.4579e-01],
            [-2.1883e-01, -2.4351e+00, -7.2915e-02, -3.3987e-02, 9.6252e-01, 3.4917e-01, -9.2146e-01, -5.6195e-02,
             -6.2270e-01, -4.6372e-01, 1.9218e+00, -4.0255e-01, 1.2390e-01, 1.1648e+00, 9.2337e-01, 1.3873e+00],
            [-1.3527e+00, -1.6959e+00, 5.6665e-01, 7.9351e-01, 5.9884e-01, -1.5551e+00, -3.4136e-01, 1.8530e+00,
             7.5019e-01, -5.8550e-01, -1.7340e-01, 1.8348e-01, 1.3894e+00, 1.5863e+00, 9.4630e-01, -8.4368e-01],
            [-6.7309e-01, 8.7283e-01, 1.0554e+00, 1.7784e-01, -2.3034e-01, -3.9175e-01, 5.4329e-01, -3.9516e-01,
             -4.4622e-01, 7.4402e-01, 1.5210e+00, 3.4105e+00, -1.5312e+00, -1.2341e+00, 1.8197e+00, -5.5153e-01]),
        "chosen-word": numbers([-0.2188, -2.4351, -0.0729, -0.0340, 0.9625, 0.3492, -0.9215, -0.0562,
                                -0.6227, -0.4637, 1.9218, -0.4025, 0.1239, 1.1648, 0.9234, 1.3873]),
        # query (24), key (24), the first 14 entries of the value (the export cut it there).
        "word-projections": numbers(
            [-2.1911, -1.4461, 0.4942, -0.9959, -4.7663, -4.8887, 9.3072, 5.8991, -3.8935, -4.2999, -1.3099, -1.1042,
             -13.4091, -2.6684, -1.8868, -1.6594, 4.1670, -4.1148, 0.0935, 9.3019, -1.6530, 2.6375, -5.8936, -0.0373],
            [7.7921, -3.4727, 3.3231, 0.8337, 7.1973, 2.5318, -3.6451, 4.7367, -6.4336, 0.5191, -8.1601, -8.5292,
             1.0385, -2.9421, 3.7129, -0.4032, 7.9608, 8.9526, -0.7115, -2.3812, -1.3893, 3.9426, -0.2862, 0.7675],
            [-0.3520, -3.7708, -3.8933, -4.7494, -3.1310, -2.4028, 4.3370, 0.2605, -1.4421, -2.1825, -7.1633, -3.5063,
             2.2980, 2.6982], atol=3e-4),
        # Scores in the hundreds, summed in float32 in another order than the seed's.
        "scores": numbers([32.4191, -44.9209, 30.4341, -121.9629, -61.8859, -123.4025, 171.9292, 4.6947, 79.1044],
                          atol=1e-3),
        "weights": numbers([4.2897e-13, 5.9736e-20, 2.8606e-13, 8.8403e-27, 1.8719e-21, 6.5893e-27, 1.0000e+00,
                            1.4951e-15, 5.9031e-09], atol=0, rtol=3e-4),
        "context": numbers([-6.1658, 3.3317, -1.4784, 3.0280, -3.0778, -1.9382, 3.2093, 2.9632, 4.7867, 2.5697,
                            -1.9187, -0.8907, 3.5392, -0.1726, -2.6539, 5.6142, -1.1907, 2.2681, -6.4134, 2.0330,
                            3.2004, -8.4279, -5.9757, -6.8775, 3.2998, 4.7060, -3.5087, 5.1399], atol=3e-4),
        "stacked-shapes": lines("torch.Size([3, 24, 16]) torch.Size([3, 24, 16]) torch.Size([3, 28, 16])",
                                "queries: (3, 24)", "keys: (3, 9, 24)", "values: (3, 9, 28)", "scores: (3, 9)",
                                "weights: (3, 9)", "context per head: (3, 28)"),
        "cross-shapes": lines("(8, 24)", "(8, 28)", "torch.Size([8]) torch.Size([28])"),
    },
    "002_attention_step_by_step": {
        "journey-scores": numbers(SEED002_SCORES_ROW_2),
        "journey-normalised": numbers([0.1455, 0.2278, 0.2249, 0.1285, 0.1077, 0.1656]),
        "journey-weights": numbers(SEED002_WEIGHTS[1]),
        "journey-context": numbers(SEED002_CONTEXT[1]),
        "all-scores": numbers(SEED002_ALL_SCORES),
        "all-weights": numbers(SEED002_WEIGHTS),
        "all-context": numbers(SEED002_CONTEXT),
        "projection-matrices": numbers([[0.2961, 0.5166], [0.2517, 0.6886], [0.0740, 0.8665]],
                                       [[0.1366, 0.1025], [0.1841, 0.7264], [0.3153, 0.6871]],
                                       [[0.0756, 0.1966], [0.3164, 0.4017], [0.1186, 0.8274]]),
        "projections": numbers(  # queries, keys, values
            [[0.2309, 1.0966], [0.4306, 1.4551], [0.4300, 1.4343],
             [0.2355, 0.7990], [0.2983, 0.6565], [0.2568, 1.0533]],
            [[0.3669, 0.7646], [0.4433, 1.1419], [0.4361, 1.1156],
             [0.2408, 0.6706], [0.1827, 0.3292], [0.3275, 0.9642]],
            [[0.1855, 0.8812], [0.3951, 1.0037], [0.3879, 0.9831],
             [0.2393, 0.5493], [0.1492, 0.3346], [0.3221, 0.7863]]),
        "trainable-scores": numbers(SEED002_TRAINABLE_SCORES),
        "trainable-weights": numbers([
            [0.1551, 0.2104, 0.2059, 0.1413, 0.1074, 0.1799],
            [0.1500, 0.2264, 0.2199, 0.1311, 0.0906, 0.1820],
            [0.1503, 0.2256, 0.2192, 0.1315, 0.0914, 0.1819],
            [0.1591, 0.1994, 0.1962, 0.1477, 0.1206, 0.1769],
            [0.1610, 0.1949, 0.1923, 0.1501, 0.1265, 0.1752],
            [0.1557, 0.2092, 0.2048, 0.1419, 0.1089, 0.1794]]),
        "trainable-context": numbers(seed002_printed.TRAINABLE_CONTEXT),
        "linear-head": numbers([[-0.5337, -0.1051], [-0.5323, -0.1080], [-0.5323, -0.1079],
                                [-0.5297, -0.1076], [-0.5311, -0.1066], [-0.5299, -0.1081]]),
        "causal-masked-scores": numbers([[s if j <= i else -INF for j, s in enumerate(row)]
                                         for i, row in enumerate(SEED002_TRAINABLE_SCORES)]),
        "causal-weights": numbers(seed002_printed.CAUSAL_WEIGHTS),
        "batch-shape": lines("torch.Size([2, 6, 3])"),
        "head-list-shape": lines("torch.Size([2, 6, 4])"),
        "multi-head-output": numbers(SEED002_SPLIT_HEADS_OUTPUT, SEED002_SPLIT_HEADS_OUTPUT),
        # The induction-head demo (attnkit.models.induction, 200 steps; measured: 4.30 and 0.11).
        # The first half is random: nothing beats ln(64) = 4.16 there. The repeated half is copied:
        # a tenth of that means the model predicts it from context.
        "induction-losses": bounded(("loss on the first half:", 0.9 * math.log(64), None),
                                    ("loss on the repeated half:", None, 0.1 * math.log(64))),
        # Measured: layer 1, head 0, prefix matching 1.00, copying 0.99. A head spreading its attention
        # evenly over the causal keys gives the induction target at most 1/17 = 0.06 of a second-half
        # query's weight; 0.5 is the majority of the weight on the one key an induction head must pick.
        # It needs what layer 0 wrote about each position's predecessor, so it sits in layer 1.
        "induction-scores": bounded(("induction head: layer", 1, 1), ("prefix-matching score", 0.5, None),
                                    ("copying score", 0.5, None)),
    },
    "003_multi_head_reshapes": {
        "split-queries": numbers(SEED003_QUERIES_SPLIT),
        # Our inputs are the seed's printout (4 decimals): a few 1e-4 of difference downstream.
        "scores": numbers(SEED003_SCORES, atol=4e-4),
        "masked-scores": numbers(SEED003_MASKED_SCORES, atol=4e-4),
        "seed-weights": numbers(SEED003_WEIGHTS, atol=3e-4),
        "boolean-weights": numbers([[0.5943, 0.0000, 0.4057], [0.0, 0.0, 0.0], [1.0000, 0.0000, 0.0000]],
                                   [[0.4725, 0.0000, 0.5275], [0.0, 0.0, 0.0], [1.0000, 0.0000, 0.0000]], atol=3e-4),
        "heads": numbers(SEED003_HEADS_BATCH_0, EMPTY_ROW_BATCH_1, atol=4e-4),
        "joined": numbers([[0.5662, 1.2474, 0.6110, 0.3846, 0.7495, 0.0327, -0.5575, -0.4441],
                           [0.4764, 0.7553, 0.3367, 0.5807, 0.7607, 0.0516, -0.5495, -0.4652]], atol=4e-4),
        "layer-shape": lines("torch.Size([2, 3, 8]) torch.Size([2, 2, 3, 3])"),
    },
    "004_attention_layer": {
        "shapes": lines("Input shape: torch.Size([2, 3, 4])", "Output shape: torch.Size([2, 3, 2])",
                        "Attention weights shape: torch.Size([2, 3, 3])"),
        # A random Llama (2 layers, logits about 5 in size) through transformers' eager attention and
        # through attnkit: float32 rounding in another summation order (measured 5e-6), where a scale
        # 10% off moves the logits by 0.6. Eager makes no attnkit call; attnkit one per layer.
        "transformers-logits": bounded(("max |attnkit - eager| over the logits:", 0.0, 1e-4),
                                       ("eager:", 0, 0), ("attnkit:", 2, 2)),
    },
}
