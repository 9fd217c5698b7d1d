//! Model runtime: every checkpoint format written by real PyTorch loads into the TorchScript
//! architecture and reproduces PyTorch's forward; bad checkpoints are refused with clear errors.

use crate::common::{fixtures, h5_tensor, run_python};
use diffmon::engine::model::Model;
use diffmon::weights::ReadOptions;
use tch::{Device, Tensor};

fn arch() -> Model {
    Model::load(&fixtures().join("arch.ts"), Device::Cpu).unwrap()
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a - b).abs().max().double_value(&[])
}

/// Loads `file` with `opts` and checks the forward against PyTorch's on the reference inputs.
fn assert_reproduces_pytorch(file: &str, opts: ReadOptions) {
    let dir = fixtures();
    let mut model = arch();
    let reference = dir.join("reference.h5");
    let x = h5_tensor(&reference, "x");
    let sigma = h5_tensor(&reference, "sigma");
    let (d0, _) = model.forward(&x, &sigma).unwrap();
    model.load_weights(&dir.join(file), &opts).unwrap();
    let (d, f) = model.forward(&x, &sigma).unwrap();
    let want_d = h5_tensor(&reference, "denoised");
    let want_f = h5_tensor(&reference, "features");
    // Same float32 kernels on the same CPU: differences are reordering noise, far below 1e-5.
    assert!(
        max_abs_diff(&d, &want_d) <= 1e-5,
        "{file}: denoised differs by {}",
        max_abs_diff(&d, &want_d)
    );
    assert!(
        max_abs_diff(&f, &want_f) <= 1e-5,
        "{file}: features differ by {}",
        max_abs_diff(&f, &want_f)
    );
    // The architecture's own initial weights give a different output: the load did something.
    assert!(
        max_abs_diff(&d0, &want_d) > 1e-3,
        "{file}: initial weights already match"
    );
}

#[test]
fn ordered_dict_state_dict_loads() {
    assert_reproduces_pytorch("ckpt_state_dict.pt", ReadOptions::default());
}

#[test]
fn nested_ema_dict_loads_with_weights_key() {
    let opts = ReadOptions {
        weights_key: Some("ema".into()),
        strip_prefix: None,
        ..ReadOptions::default()
    };
    assert_reproduces_pytorch("ckpt_ema.pt", opts);
}

#[test]
fn module_prefix_is_stripped() {
    let opts = ReadOptions {
        weights_key: None,
        strip_prefix: Some("module.".into()),
        ..ReadOptions::default()
    };
    assert_reproduces_pytorch("ckpt_module_prefix.pt", opts);
}

#[test]
fn safetensors_loads() {
    assert_reproduces_pytorch("ckpt.safetensors", ReadOptions::default());
}

#[test]
fn torchscript_checkpoint_loads() {
    assert_reproduces_pytorch("ckpt.ts", ReadOptions::default());
}

#[test]
fn buffers_are_loaded_too() {
    // BatchNorm running statistics are buffers, not parameters: they must come from the checkpoint.
    let dir = fixtures();
    let mut model = arch();
    model
        .load_weights(&dir.join("ckpt_state_dict.pt"), &ReadOptions::default())
        .unwrap();
    let names: Vec<String> = model.state_shapes().into_iter().map(|(n, _)| n).collect();
    assert!(
        names.iter().any(|n| n.ends_with("running_mean")),
        "{names:?}"
    );
}

#[test]
fn foreign_pickle_global_is_refused_and_never_executed() {
    let dir = fixtures();
    let mut model = arch();
    let err = model
        .load_weights(&dir.join("ckpt_evil.pt"), &ReadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("ckpt_evil.pt"), "{err}");
    assert!(err.contains("system"), "{err}");
    assert!(!dir.join("PWNED").exists(), "the pickle's command ran");
}

#[test]
fn truncated_and_empty_files_are_errors_naming_them() {
    let dir = fixtures();
    let mut model = arch();
    for file in ["ckpt_truncated.pt", "ckpt_zero.pt"] {
        let err = model
            .load_weights(&dir.join(file), &ReadOptions::default())
            .unwrap_err()
            .to_string();
        assert!(err.contains(file), "{err}");
    }
}

#[test]
fn mismatched_weights_list_the_names_and_leave_the_model_unchanged() {
    let dir = fixtures();
    let mut model = arch();
    model
        .load_weights(&dir.join("ckpt_state_dict.pt"), &ReadOptions::default())
        .unwrap();
    let reference = dir.join("reference.h5");
    let (x, sigma) = (h5_tensor(&reference, "x"), h5_tensor(&reference, "sigma"));
    let (before, _) = model.forward(&x, &sigma).unwrap();

    let err = model
        .load_weights(&dir.join("ckpt_wrong_shape.pt"), &ReadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("ckpt_wrong_shape.pt") && err.contains("shape mismatch"),
        "{err}"
    );
    let err = model
        .load_weights(&dir.join("ckpt_missing_keys.pt"), &ReadOptions::default())
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("ckpt_missing_keys.pt") && err.contains("missing (1)"),
        "{err}"
    );
    let (after, _) = model.forward(&x, &sigma).unwrap();
    assert_eq!(
        max_abs_diff(&before, &after),
        0.0,
        "a failed load changed the weights"
    );
    // A `module.` prefix on every name is found and removed without strip_prefix.
    model
        .load_weights(&dir.join("ckpt_module_prefix.pt"), &ReadOptions::default())
        .unwrap();
}

#[test]
fn contract_violations_are_reported_with_what_was_found() {
    let dir = tempfile::tempdir().unwrap();
    let single = dir.path().join("single.ts");
    let wrong = dir.path().join("wrong_shape.ts");
    let script = dir.path().join("make.py");
    std::fs::write(
        &script,
        format!(
            r#"
import torch
class Single(torch.nn.Module):
    def forward(self, x, sigma):
        return x * 2
class Wrong(torch.nn.Module):
    def forward(self, x, sigma):
        return x[:, :, :4, :4], x.mean(dim=(2, 3))
torch.jit.script(Single()).save({single:?})
torch.jit.script(Wrong()).save({wrong:?})
"#
        ),
    )
    .unwrap();
    run_python(&[script.to_str().unwrap()]);
    let err = Model::load(&single, Device::Cpu)
        .unwrap()
        .check_contract(&[1, 8, 8])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("single.ts") && err.contains("expected a tuple (denoised, features)"),
        "{err}"
    );
    let err = Model::load(&wrong, Device::Cpu)
        .unwrap()
        .check_contract(&[1, 8, 8])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("denoised output has shape [2, 1, 4, 4]"),
        "{err}"
    );
    let ok = Model::load(&fixtures().join("arch.ts"), Device::Cpu).unwrap();
    let info = ok.check_contract(&[1, 16, 16]).unwrap();
    assert!(info.feature_dim > 0);
}

/// On the CPU the network runs in the channels-last layout (its 4-dimensional weights and its
/// input; the outputs come back contiguous): oneDNN's convolutions are faster so
/// (docs/guide/cost-and-gpu.md). A network whose code needs contiguous memory (a `view` of a
/// convolution's output) fails there once, goes back to the contiguous layout for good and gives
/// PyTorch's own output, then and at every later call; checkpoints load into either.
#[test]
fn a_network_that_needs_contiguous_memory_goes_back_to_the_contiguous_layout() {
    let toy = arch();
    // A convolution of several input channels and a 3×3 kernel (one input channel is both
    // layouts at once).
    let (name, _) = toy
        .state_shapes()
        .into_iter()
        .find(|(_, s)| s.len() == 4 && s[1] > 1 && s[2] > 1)
        .unwrap();
    assert!(
        !toy.tensor(&name).unwrap().is_contiguous(),
        "the toy's {name} is not in the channels-last layout"
    );
    let dir = tempfile::tempdir().unwrap();
    let (net, reference) = (dir.path().join("flat.ts"), dir.path().join("flat.h5"));
    let script = dir.path().join("make.py");
    std::fs::write(
        &script,
        format!(
            r#"
import h5py, torch
class Flat(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(2, 4, 3, padding=1)
    def forward(self, x, sigma):
        h = self.conv(x)
        return x - sigma.view(-1, 1, 1, 1) * h[:, :2], h.view(h.shape[0], -1)
torch.manual_seed(0)
net = torch.jit.script(Flat().eval())
net.save({net:?})
x, sigma = torch.randn(3, 2, 8, 8), torch.rand(3)
with torch.no_grad():
    d, f = net(x, sigma)
    try:
        net(x.contiguous(memory_format=torch.channels_last), sigma)
        raise SystemExit("the view ran in the channels-last layout: the test shows nothing")
    except RuntimeError:
        pass
with h5py.File({reference:?}, "w") as h:
    h["x"], h["sigma"], h["denoised"], h["features"] = x.numpy(), sigma.numpy(), d.numpy(), f.numpy()
"#
        ),
    )
    .unwrap();
    run_python(&[script.to_str().unwrap()]);
    let model = Model::load(&net, Device::Cpu).unwrap();
    let x = h5_tensor(&reference, "x");
    let sigma = h5_tensor(&reference, "sigma");
    for call in 0..2 {
        let (d, f) = model.forward(&x, &sigma).unwrap();
        for (got, want) in [(&d, "denoised"), (&f, "features")] {
            let diff = max_abs_diff(got, &h5_tensor(&reference, want));
            assert!(diff <= 1e-6, "call {call}: {want} differs by {diff}");
        }
    }
    assert!(model.tensor("conv.weight").unwrap().is_contiguous());
}
