use super::*;
use burn::tensor::{Device, TensorData};

/// Two pairs, by hand: policy loss sums (−Σ log p) of chosen rows 0–1 and rejected rows 2–3,
/// the reference's, and each row's target tokens.
const POLICY: [f32; 4] = [10.0, 14.0, 12.0, 11.0];
const REFERENCE: [f32; 4] = [11.0, 13.5, 11.0, 12.5];
const TOKENS: [f32; 4] = [4.0, 5.0, 3.0, 6.0];
const BETA: f64 = 0.3;

fn sums(values: [f32; 4], device: &Device, grad: bool) -> LossSums {
    let t = Tensor::<1>::from_data(TensorData::new(values.to_vec(), [4]), device);
    let loss_sum = if grad { t.require_grad() } else { t };
    LossSums { loss_sum, tokens: Tensor::from_data(TensorData::new(TOKENS.to_vec(), [4]), device) }
}

/// The log-ratios by hand: chosen `(−p + r)` of rows 0–1, rejected of rows 2–3.
fn ratios() -> ([f64; 2], [f64; 2]) {
    let r = |i: usize| f64::from(REFERENCE[i]) - f64::from(POLICY[i]);
    ([r(0), r(1)], [r(2), r(3)])
}

/// The loss and the gradient of the policy's loss sums, for `losses`.
fn run(losses: Vec<(PreferenceLoss, f64)>) -> (f64, Vec<f64>, PairStats) {
    let device = Device::libtorch().autodiff();
    let policy = sums(POLICY, &device, true);
    let objective = PreferenceObjective { beta: BETA, losses, reference: Reference::Base };
    let (loss, stats) = preference_loss(&policy, &sums(REFERENCE, &device, false).loss_sum, &objective);
    let value = f64::from(loss.clone().into_scalar::<f32>());
    let grads = loss.backward();
    let g = policy.loss_sum.grad(&grads).unwrap().into_data().convert::<f64>().into_vec::<f64>().unwrap();
    (value, g, stats)
}

fn close(got: f64, want: f64, what: &str) {
    assert!((got - want).abs() <= 1e-6 * want.abs().max(1.0), "{what}: {got} vs {want}");
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// DPO: `mean ln(1 + e^(−βΔ))`; its derivative in a chosen row's loss sum is
/// `β·σ(−βΔ)/P` (a larger loss sum is a smaller log-probability), the rejected row's the
/// negative; TRL's statistics from the same ratios.
#[test]
fn sigmoid_loss_gradient_and_rewards_by_hand() {
    let ([c0, c1], [r0, r1]) = ratios();
    let deltas = [c0 - r0, c1 - r1];
    let want: f64 = deltas.iter().map(|d| (1.0 + (-BETA * d).exp()).ln()).sum::<f64>() / 2.0;
    let (loss, g, stats) = run(vec![(PreferenceLoss::Sigmoid, 1.0)]);
    close(loss, want, "loss");
    for (i, d) in deltas.iter().enumerate() {
        let dc = BETA * sigmoid(-BETA * d) / 2.0;
        close(g[i], dc, "chosen gradient");
        close(g[i + 2], -dc, "rejected gradient");
    }
    close(stats.rewards_chosen, BETA * (c0 + c1) / 2.0, "rewards/chosen");
    close(stats.rewards_rejected, BETA * (r0 + r1) / 2.0, "rewards/rejected");
    close(stats.rewards_margin, BETA * (deltas[0] + deltas[1]) / 2.0, "rewards/margins");
    let wins = deltas.iter().filter(|d| **d > 0.0).count() as f64 / 2.0;
    close(stats.rewards_accuracy, wins, "rewards/accuracies");
    close(stats.logps_chosen, -(10.0 + 14.0) / 2.0, "logps/chosen");
    close(stats.logps_rejected, -(12.0 + 11.0) / 2.0, "logps/rejected");
}

/// The hinge `max(0, 1 − βΔ)`: both pairs are inside the margin (Δ = 2 and −2: βΔ = ±0.6 < 1),
/// each row's gradient `±β/P`.
#[test]
fn hinge_loss_by_hand() {
    let ([c0, c1], [r0, r1]) = ratios();
    let deltas = [c0 - r0, c1 - r1];
    let want: f64 = deltas.iter().map(|d| (1.0 - BETA * d).max(0.0)).sum::<f64>() / 2.0;
    let (loss, g, _) = run(vec![(PreferenceLoss::Hinge, 1.0)]);
    close(loss, want, "loss");
    for (i, d) in deltas.iter().enumerate() {
        let dc = if 1.0 - BETA * d > 0.0 { BETA / 2.0 } else { 0.0 };
        close(g[i], dc, "chosen gradient");
        close(g[i + 2], -dc, "rejected gradient");
    }
}

/// IPO with TRL's per-token averaging: `mean (c/n_c − r/n_r − 1/(2β))²`, gradient
/// `−2·(…)/(n_c·P)` in a chosen row's loss sum.
#[test]
fn ipo_loss_averages_per_token_by_hand() {
    let ([c0, c1], [r0, r1]) = ratios();
    let n = TOKENS.map(f64::from);
    let inner = [c0 / n[0] - r0 / n[2] - 1.0 / (2.0 * BETA), c1 / n[1] - r1 / n[3] - 1.0 / (2.0 * BETA)];
    let want = (inner[0].powi(2) + inner[1].powi(2)) / 2.0;
    let (loss, g, _) = run(vec![(PreferenceLoss::Ipo, 1.0)]);
    close(loss, want, "loss");
    for (i, v) in inner.iter().enumerate() {
        close(g[i], -2.0 * v / n[i] / 2.0, "chosen gradient");
        close(g[i + 2], 2.0 * v / n[i + 2] / 2.0, "rejected gradient");
    }
}

/// DPO plus half TRL's SFT term: the chosen rows' loss sums over their tokens (24 / 9), whose
/// gradient `0.5/9` adds to each chosen row's and to no rejected row's.
#[test]
fn an_sft_term_adds_the_chosen_tokens_mean_nll() {
    let (dpo, g_dpo, _) = run(vec![(PreferenceLoss::Sigmoid, 1.0)]);
    let (both, g, _) = run(vec![(PreferenceLoss::Sigmoid, 1.0), (PreferenceLoss::Sft, 0.5)]);
    close(both, dpo + 0.5 * (10.0 + 14.0) / (4.0 + 5.0), "loss");
    for i in 0..4 {
        let extra = if i < 2 { 0.5 / 9.0 } else { 0.0 };
        close(g[i], g_dpo[i] + extra, "gradient");
    }
}
