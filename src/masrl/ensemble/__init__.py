"""masrl.ensemble: offline LLM-ensemble selection, diversity metrics and RL-Focal.

Load per-model predictions, measure diversity, combine answers, choose proposer subsets with
a labeled selection set (with cost counted in combiner/summarizer calls), and train RL-Focal's
Decider + Fusion agents. See docs/ensembles.md.

    from masrl.ensemble import load_jsonl, split_indices, run_selector, train_rl_focal
    data = load_jsonl("rlfocal_bbh/bbh.jsonl")          # resolved under $MASRL_DATA_DIR/ensembles
    split = split_indices(data)                          # RL-Focal's split (first 80% of each task)
    res = run_selector(data, split, "forward", k=3, combiner="plurality")
"""
from masrl.ensemble.combiners import (COMBINER_NAMES, Combiner, Majority, Oracle, Plurality, SoftVote, Summarizer,
                                      get_combiner, plurality_correct, plurality_predict, soft_vote_predict)
from masrl.ensemble.data import (EnsembleData, MalformedRowWarning, Split, from_records, load_jsonl,
                                 resolve_data_path, split_indices)
from masrl.ensemble.metrics import (binary_entropy, cohen_kappa, correlation, disagreement, diversity_summary,
                                    double_fault, fleiss_kappa, kw_kappa, focal_diversity, focal_lambdas,
                                    generalized_diversity, kuncheva_entropy, mean_pairwise, pair_counts,
                                    pairwise_matrix, q_statistic)
from masrl.ensemble.rlfocal import PRESETS, RLFocalConfig, RLFocalResult, train_rl_focal
from masrl.ensemble.selectors import (SELECTORS, SelectionProblem, SelectionResult, SelectionSummary,
                                      SubsetEvaluator, baselines, expected_cost, fitness, run_selector, select)

__all__ = [
    "EnsembleData", "MalformedRowWarning", "Split", "from_records", "load_jsonl", "resolve_data_path",
    "split_indices",
    "pair_counts", "q_statistic", "correlation", "disagreement", "double_fault", "cohen_kappa", "kw_kappa", "pairwise_matrix",
    "mean_pairwise", "fleiss_kappa", "binary_entropy", "kuncheva_entropy", "generalized_diversity",
    "focal_diversity", "focal_lambdas", "diversity_summary",
    "Combiner", "Plurality", "SoftVote", "Oracle", "Majority", "Summarizer", "get_combiner", "COMBINER_NAMES",
    "plurality_correct", "plurality_predict", "soft_vote_predict",
    "SELECTORS", "SelectionProblem", "SelectionResult", "SelectionSummary", "SubsetEvaluator", "select",
    "run_selector", "baselines", "expected_cost", "fitness",
    "RLFocalConfig", "RLFocalResult", "train_rl_focal", "PRESETS",
]
