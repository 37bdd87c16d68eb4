"""Numbers printed by seed 002 for its trainable head (W_query, W_key, W_value from
torch.manual_seed(123); torch.rand(3, 2) three times), used by the core's and the layers' parity tests."""

import torch

TRAINABLE_CONTEXT = torch.tensor([
    [0.2996, 0.8053], [0.3061, 0.8210], [0.3058, 0.8203], [0.2948, 0.7939], [0.2927, 0.7891], [0.2990, 0.8040]])

CAUSAL_WEIGHTS = torch.tensor([
    [1.0000, 0.0000, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.3986, 0.6014, 0.0000, 0.0000, 0.0000, 0.0000],
    [0.2526, 0.3791, 0.3683, 0.0000, 0.0000, 0.0000],
    [0.2265, 0.2839, 0.2794, 0.2103, 0.0000, 0.0000],
    [0.1952, 0.2363, 0.2331, 0.1820, 0.1534, 0.0000],
    [0.1557, 0.2092, 0.2048, 0.1419, 0.1089, 0.1794]])
