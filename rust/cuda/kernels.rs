//! The csrc kernels: their sources (embedded in the binary, so the cache key
//! always matches what runs), compile options, and per-device loading.

use super::driver::{check, DeviceInfo};
use super::nvrtc::{self, Source};
use super::{cache, stream::RawStream};
use crate::dtype::Dtype;
use crate::error::Result;
use cudarc::driver::sys;
use std::collections::HashMap;
use std::ffi::{c_void, CString};
use std::sync::Mutex;

const HEADERS: &[Source] = &[
    Source {
        name: "ptx.cuh",
        text: include_str!("../../csrc/ptx.cuh"),
    },
    Source {
        name: "ptx_sm90.cuh",
        text: include_str!("../../csrc/ptx_sm90.cuh"),
    },
];

const SOURCES: &[Source] = &[
    Source {
        name: "gemm_signal_sm80.cu",
        text: include_str!("../../csrc/gemm_signal_sm80.cu"),
    },
    Source {
        name: "gemm_signal_sm90.cu",
        text: include_str!("../../csrc/gemm_signal_sm90.cu"),
    },
    Source {
        name: "peer_reduce.cu",
        text: include_str!("../../csrc/peer_reduce.cu"),
    },
    Source {
        name: "unreorder.cu",
        text: include_str!("../../csrc/unreorder.cu"),
    },
    Source {
        name: "add_rmsnorm.cu",
        text: include_str!("../../csrc/add_rmsnorm.cu"),
    },
    Source {
        name: "allreduce_rmsnorm.cu",
        text: include_str!("../../csrc/allreduce_rmsnorm.cu"),
    },
];

/// One compiled variant of one kernel.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KernelSpec {
    pub source: &'static str,
    pub entry: &'static str,
    pub defines: Vec<(&'static str, String)>,
    pub dynamic_smem: u32,
}

impl KernelSpec {
    /// The value of the -D `name` it is compiled with, if any.
    pub fn define(&self, name: &str) -> Option<&str> {
        self.defines
            .iter()
            .find(|(k, _)| *k == name)
            .map(|(_, v)| v.as_str())
    }

    fn main(&self) -> Source {
        *SOURCES
            .iter()
            .find(|s| s.name == self.source)
            .expect("every spec names an embedded source")
    }

    fn options(&self, arch: &str) -> Vec<String> {
        let mut o = vec![format!("--gpu-architecture={arch}"), "-std=c++17".into()];
        o.extend(self.defines.iter().map(|(k, v)| format!("-D{k}={v}")));
        o.extend(extra_options(
            std::env::var("FLASHOVERLAP_NVRTC_OPTIONS").ok().as_deref(),
        ));
        o
    }
}

/// Options a user adds to every compilation (`FLASHOVERLAP_NVRTC_OPTIONS`,
/// split on whitespace), e.g. `-lineinfo` so that compute-sanitizer and Nsight
/// name source lines. They are part of the cache key like every option.
fn extra_options(var: Option<&str>) -> Vec<String> {
    var.map(|v| v.split_whitespace().map(String::from).collect())
        .unwrap_or_default()
}

/// The GEMM kernels: the portable mma.sync one and the Hopper wgmma/TMA one
/// (with its tile's N). Each knows its tile and launch shape.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemmKernel {
    /// sm_80 and newer. BK = 64 measured 1.25x faster than 32 on H200 (fewer
    /// barriers per K); 3 stages (96 KiB) fit every sm_80+ part, a 4th gained ~2%.
    Sm80,
    /// sm_90a only: TMA + wgmma, 128 x `bn` tiles.
    Sm90 { bn: u32 },
}

const SM80_STAGES: u32 = 3;
/// Dynamic shared memory an sm_90 block may use, and the sm90 kernel's
/// epilogue buffer (128 x 128 16-bit outputs).
const SM90_SMEM: u32 = 227 * 1024;
const SM90_EPILOGUE: u32 = 128 * 128 * 2;

impl GemmKernel {
    pub const ALL: [GemmKernel; 3] = [
        GemmKernel::Sm80,
        GemmKernel::Sm90 { bn: 128 },
        GemmKernel::Sm90 { bn: 256 },
    ];

    /// (BM, BN, BK) of one CTA iteration; plan/ tiles the output with it.
    pub fn tile(self) -> (u32, u32, u32) {
        match self {
            GemmKernel::Sm80 => (128, 128, 64),
            GemmKernel::Sm90 { bn } => (128, bn, 64),
        }
    }

    pub fn threads(self) -> u32 {
        match self {
            GemmKernel::Sm80 => 256,
            GemmKernel::Sm90 { .. } => 384,
        }
    }

    fn stages(self) -> u32 {
        match self {
            GemmKernel::Sm80 => SM80_STAGES,
            // As many stages as fit beside the epilogue buffer in the 227 KiB
            // an sm_90 block may have: 4 for BN = 256, 6 for BN = 128.
            GemmKernel::Sm90 { bn } => (SM90_SMEM - SM90_EPILOGUE - 1024) / ((128 + bn) * 64 * 2),
        }
    }

    pub fn name(self) -> String {
        match self {
            GemmKernel::Sm80 => "sm80".into(),
            GemmKernel::Sm90 { bn } => format!("sm90_n{bn}"),
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|k| k.name() == name)
    }

    /// Whether an NVRTC target (e.g. "sm_90a") can run it.
    pub fn runs_on(self, arch: &str) -> bool {
        match self {
            GemmKernel::Sm80 => arch
                .strip_prefix("sm_")
                .and_then(|v| v.trim_end_matches('a').parse::<u32>().ok())
                .is_some_and(|v| v >= 80),
            GemmKernel::Sm90 { .. } => arch == "sm_90a",
        }
    }

    /// The kernel a device uses when the caller does not name one: on Hopper
    /// the wgmma kernel with plan/'s tile width, elsewhere the mma.sync kernel.
    pub fn default_for(major: i32) -> Self {
        if major == 9 {
            GemmKernel::Sm90 {
                bn: crate::plan::HOPPER_TILE_N,
            }
        } else {
            GemmKernel::Sm80
        }
    }

    /// The sm_90 kernel with combined stores compiled in (FO_COMBINE: the
    /// push and copy-engine ReduceScatter on 2 ranks); other kernels as
    /// [`GemmKernel::spec`].
    pub fn spec_combined(self, dtype: Dtype) -> KernelSpec {
        let mut spec = self.spec(dtype);
        if matches!(self, GemmKernel::Sm90 { .. }) {
            spec.defines.push(("FO_COMBINE", "1".to_string()));
        }
        spec
    }

    pub fn spec(self, dtype: Dtype) -> KernelSpec {
        let (bm, bn, bk) = self.tile();
        let stages = self.stages();
        let bf16 = if dtype == Dtype::Bf16 { "1" } else { "0" }.to_string();
        match self {
            GemmKernel::Sm80 => KernelSpec {
                source: "gemm_signal_sm80.cu",
                entry: "fo_gemm_signal",
                defines: vec![
                    ("FO_BF16", bf16),
                    ("FO_BK", bk.to_string()),
                    ("FO_STAGES", stages.to_string()),
                ],
                dynamic_smem: stages * (bm + bn) * bk * 2,
            },
            GemmKernel::Sm90 { .. } => KernelSpec {
                source: "gemm_signal_sm90.cu",
                entry: "fo_gemm_signal_sm90",
                defines: vec![
                    ("FO_BF16", bf16),
                    ("FO_BN", bn.to_string()),
                    ("FO_STAGES", stages.to_string()),
                ],
                // The stages, the epilogue buffer, then a full and an empty
                // mbarrier per stage and the combined stores' one.
                dynamic_smem: stages * (bm + bn) * bk * 2 + SM90_EPILOGUE + stages * 16 + 8,
            },
        }
    }
}

/// Threads per block of the peer reduction.
pub const PEER_REDUCE_THREADS: u32 = 512;

/// The copy-engine AllReduce's reduction of `ranks` partials (2..=8) on a
/// device of compute capability `major`: each thread loads 8 16-byte
/// vectors per tile whatever the world size, and Hopper keeps 3 tiles in
/// flight (192 KiB of shared memory per block), older GPUs 2 (at most 128).
pub fn peer_reduce_spec(dtype: Dtype, ranks: u32, major: i32) -> KernelSpec {
    let bf16 = if dtype == Dtype::Bf16 { "1" } else { "0" }.to_string();
    let (stages, vectors) = if major >= 9 { (3, 8) } else { (2, 4) };
    let per_thread = (vectors / ranks).max(1);
    KernelSpec {
        source: "peer_reduce.cu",
        entry: "fo_peer_reduce",
        defines: vec![
            ("FO_BF16", bf16),
            ("FO_RANKS", ranks.to_string()),
            ("FO_VPT", per_thread.to_string()),
            ("FO_STAGES", stages.to_string()),
        ],
        dynamic_smem: stages * ranks * per_thread * PEER_REDUCE_THREADS * 16,
    }
}

/// Threads per block of the un-reorder copy.
pub const UNREORDER_THREADS: u32 = 1024;

/// The copy of staged `bm` x `bn` tiles into the row-major output (any
/// 16-bit dtype: it moves bytes).
pub fn unreorder_spec(bm: u32, bn: u32) -> KernelSpec {
    KernelSpec {
        source: "unreorder.cu",
        entry: "fo_unreorder",
        defines: vec![("FO_BM", bm.to_string()), ("FO_BN", bn.to_string())],
        dynamic_smem: 0,
    }
}

/// Threads per block of the fused add + RMSNorm (a warp per row), and the
/// widest row the ops accept.
pub const ADD_RMSNORM_THREADS: u32 = 512;
pub const ADD_RMSNORM_MAX_N: u32 = 16384;

/// vLLM's fused_add_rms_norm on rows of the reduced output: each lane moves
/// 2 vectors of x and 2 of the residual per step, 2 steps in flight (96 KiB
/// of shared memory per block, within every sm_80+ GPU's limit). Measured
/// on H200 (4096 x 8192 bf16, alone): 19.9 K output bytes/us/CTA on 4 CTAs,
/// vs 20.4 K with 4 vectors (128 KiB) and 19.6 K with 4 vectors, 3 stages.
pub fn add_rmsnorm_spec(dtype: Dtype) -> KernelSpec {
    let bf16 = if dtype == Dtype::Bf16 { "1" } else { "0" }.to_string();
    let (stages, vectors) = (3, 2);
    KernelSpec {
        source: "add_rmsnorm.cu",
        entry: "fo_add_rmsnorm",
        defines: vec![
            ("FO_BF16", bf16),
            ("FO_THREADS", ADD_RMSNORM_THREADS.to_string()),
            ("FO_VPT", vectors.to_string()),
            ("FO_STAGES", stages.to_string()),
        ],
        dynamic_smem: stages * 2 * vectors * ADD_RMSNORM_THREADS * 16,
    }
}

/// The peer-memory AllReduce + add + RMSNorm's shape: threads per block and
/// 16-byte vectors each lane keeps in flight (compile-time), and the most
/// parts each CTA cuts its rows into to pipeline its steps (a launch
/// parameter: `ops::all_reduce_rmsnorm::stages`). The default is the first
/// written and the one measured on 2x H200 (512 x 4: 128 registers, 48
/// bytes of spill under ptxas; one part, the steps one after the other);
/// 256 threads or 2 vectors spill nothing. Which is fastest over NVLink is
/// for the 2-GPU sweep (evaluation/bench_all_reduce_rmsnorm.py --configs)
/// to say; the others exist for that sweep.
/// `oneshot` (a launch parameter too): on two ranks keeping the full
/// residual, every rank reduces every row (see the kernel's header).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct NormConfig {
    pub threads: u32,
    pub unroll: u32,
    pub stages: u32,
    pub oneshot: bool,
    /// Rows through a shared-memory ring in bulk copies (Hopper; see
    /// all_reduce_rmsnorm::effective for where it runs).
    pub ring: bool,
}

impl NormConfig {
    /// 512 x 4 in up to 8 parts, which the default alone takes only where
    /// they pay (see all_reduce_rmsnorm::stages); `512x4` is one part always.
    /// Through the ring on Hopper (all_reduce_rmsnorm::effective: the
    /// standalone calls; gemm_all_reduce_rmsnorm's keep plain loads).
    pub const DEFAULT: Self = Self {
        threads: 512,
        unroll: 4,
        stages: 8,
        oneshot: false,
        ring: true,
    };
    /// The default on plain loads and stores.
    pub const PLAIN: Self = Self {
        ring: false,
        ..Self::DEFAULT
    };
    /// What the default runs one-shot as (all_reduce_rmsnorm::resolved):
    /// the plain build, one part.
    pub const ONESHOT: Self = Self {
        stages: 1,
        oneshot: true,
        ..Self::PLAIN
    };

    /// Whether this is the default, ring or not (its stage rule and where
    /// the ring runs follow from that).
    pub fn is_default(self) -> bool {
        Self {
            ring: false,
            ..self
        } == Self::PLAIN
    }
    /// The most parts a config may ask for.
    pub const MAX_STAGES: u32 = 16;
    /// What the 2-GPU sweep times (the default first); CI compiles each.
    /// The shapes the first sweep timed slower than the default at 8K
    /// tokens (512 x 2, 256 x 4, 256 x 2: 1.07-1.40x) are left out.
    pub const SWEEP: [Self; 4] = [
        Self::DEFAULT,
        Self {
            threads: 512,
            unroll: 4,
            stages: 1,
            oneshot: false,
            ring: false,
        },
        Self {
            threads: 512,
            unroll: 4,
            stages: 4,
            oneshot: false,
            ring: false,
        },
        Self {
            threads: 512,
            unroll: 2,
            stages: 4,
            oneshot: false,
            ring: false,
        },
    ];

    /// A config the kernel supports: 128 to 1024 threads (whole warps, a
    /// power of two), 1, 2, 4 or 8 vectors in flight, 1 to MAX_STAGES parts.
    pub fn new(threads: u32, unroll: u32, stages: u32) -> crate::error::Result<Self> {
        Self::with(threads, unroll, stages, false)
    }

    /// [`NormConfig::new`], one-shot or not.
    pub fn with(
        threads: u32,
        unroll: u32,
        stages: u32,
        oneshot: bool,
    ) -> crate::error::Result<Self> {
        if !(128..=1024).contains(&threads)
            || !threads.is_power_of_two()
            || ![1, 2, 4, 8].contains(&unroll)
            || !(1..=Self::MAX_STAGES).contains(&stages)
        {
            return Err(crate::error::Error::Invalid(format!(
                "config: expected (threads, unroll, stages) with threads a power of two in 128..=1024, unroll \
                 in 1, 2, 4, 8 and stages in 1..={}, got ({threads}, {unroll}, {stages})",
                Self::MAX_STAGES
            )));
        }
        Ok(Self {
            threads,
            unroll,
            stages,
            oneshot,
            ring: false,
        })
    }

    /// Threads a CTA is launched with: the ring adds its producer warp.
    pub fn block_threads(self) -> u32 {
        self.threads + if self.ring { NORM_PRODUCER_THREADS } else { 0 }
    }

    /// The same config with rows through the shared-memory ring (or not);
    /// a ring never runs one-shot.
    pub fn ringed(self, ring: bool) -> crate::error::Result<Self> {
        if ring && self.oneshot {
            return Err(crate::error::Error::Invalid(
                "config: the ring (r) and one-shot (o) exclude each other".into(),
            ));
        }
        if ring && self.threads > 512 {
            return Err(crate::error::Error::Invalid(format!(
                "config: the ring (r) runs at most 512 threads (its producer warp makes the CTA 32 more), got {}",
                self.threads
            )));
        }
        Ok(Self { ring, ..self })
    }
}

/// The ring's producer warp, launched ahead of the compute threads (the
/// kernel's PRODUCER).
pub const NORM_PRODUCER_THREADS: u32 = 32;

/// Shared memory of the ring variant: two or more slots of a row of every
/// array a reduce loads (world sources and the residual).
pub const NORM_RING_BYTES: u32 = 196_608;

/// The peer-memory AllReduce + residual add + RMSNorm: one warp per row,
/// plain loads, `config.unroll` vectors per lane in flight; or, with
/// `config.ring`, rows through a shared-memory ring in bulk copies.
pub fn allreduce_rmsnorm_spec(dtype: Dtype, config: NormConfig) -> KernelSpec {
    let bf16 = if dtype == Dtype::Bf16 { "1" } else { "0" }.to_string();
    KernelSpec {
        source: "allreduce_rmsnorm.cu",
        entry: "fo_allreduce_rmsnorm",
        defines: vec![
            ("FO_BF16", bf16),
            ("FO_THREADS", config.threads.to_string()),
            ("FO_UNROLL", config.unroll.to_string()),
            ("FO_RING", u8::from(config.ring).to_string()),
            ("FO_RING_BYTES", NORM_RING_BYTES.to_string()),
        ],
        dynamic_smem: if config.ring { NORM_RING_BYTES } else { 0 },
    }
}

/// The other entries of the AllReduce + RMSNorm module (csrc/allreduce_rmsnorm.cu),
/// each compiled in the same cubin as that build's fo_allreduce_rmsnorm
/// (which `all_for` compiles under that entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormEntry {
    /// fo_arn_oneshot: the plain build's one-shot by peer loads alone.
    Oneshot,
    /// fo_arn_oneshot_st: the same by peer stores into the store halves.
    OneshotStore,
    /// fo_arn_oneshot_h / fo_arn_oneshot_st_h: those two with the reduce
    /// compiled for the call's hidden size ([`for_hidden`] builds only).
    OneshotHidden,
    OneshotStoreHidden,
    /// fo_arn_ce: sums and norms of rows the copy engines moved (two-shot).
    CopyEngines,
    /// fo_arn_ce_chunks: one-shot on the copy engines in one launch that
    /// waits for each landed range's flag itself.
    CopyEngineChunks,
    /// fo_arn_ce_watch: one-shot on the copy engines, one copy whose landed
    /// values the kernel watches.
    CopyEngineWatch,
}

impl NormEntry {
    pub fn name(self) -> &'static str {
        match self {
            Self::Oneshot => "fo_arn_oneshot",
            Self::OneshotStore => "fo_arn_oneshot_st",
            Self::OneshotHidden => "fo_arn_oneshot_h",
            Self::OneshotStoreHidden => "fo_arn_oneshot_st_h",
            Self::CopyEngines => "fo_arn_ce",
            Self::CopyEngineChunks => "fo_arn_ce_chunks",
            Self::CopyEngineWatch => "fo_arn_ce_watch",
        }
    }
}

/// `entry` from the build of `config` (the ring's on Hopper where `config`
/// takes it): [`allreduce_rmsnorm_spec`]'s module.
pub fn allreduce_rmsnorm_entry_spec(
    dtype: Dtype,
    config: NormConfig,
    entry: NormEntry,
) -> KernelSpec {
    KernelSpec {
        entry: entry.name(),
        ..allreduce_rmsnorm_spec(dtype, config)
    }
}

/// `spec` compiled for rows of `hidden` values (FO_HIDDEN: the ring's
/// fo_arn_ce_watch reduces such rows on a path of its own, every offset a
/// constant, rows of another size still taking the general path; the plain
/// build adds the one-shot entries of that size, NormEntry::OneshotHidden
/// and OneshotStoreHidden).
pub fn for_hidden(mut spec: KernelSpec, hidden: u32) -> KernelSpec {
    spec.defines.push(("FO_HIDDEN", hidden.to_string()));
    spec
}

/// Whether the AllReduce + RMSNorm kernels may be compiled for a call's
/// hidden size ([`for_hidden`]): yes unless FLASHOVERLAP_NORM_HIDDEN_KERNELS
/// is "0" (then every call takes the general kernels: one compile fewer per
/// hidden size, the same results bit for bit, a little slower). Read at each
/// call; the ranks may differ.
pub fn hidden_kernels() -> bool {
    std::env::var("FLASHOVERLAP_NORM_HIDDEN_KERNELS").map_or(true, |v| v.trim() != "0")
}

/// Hidden sizes the compile check builds the hidden-size kernels for: a row
/// of whole vectors per compute thread, and one with a short last pass.
pub const CHECKED_HIDDEN: [u32; 2] = [8192, 8200];

/// Every variant the library can launch on `arch`, for the compile check CI
/// runs (the peer reduction for 2, 4 and 8 ranks, the un-reorder copy
/// for each GEMM tile, the fused add + RMSNorm), with the AllReduce +
/// RMSNorm kernels of [`CHECKED_HIDDEN`]'s hidden sizes.
pub fn all_for(arch: &str) -> Vec<KernelSpec> {
    all_with_hidden(arch, &CHECKED_HIDDEN)
}

/// [`all_for`] with the AllReduce + RMSNorm kernels compiled for each of
/// `hidden` ([`for_hidden`]: the sizes a deployment runs, so that its first
/// calls find them in the cache).
pub fn all_with_hidden(arch: &str, hidden: &[u32]) -> Vec<KernelSpec> {
    // A size asked twice is one kernel, listed once.
    let mut hidden = hidden.to_vec();
    hidden.sort_unstable();
    hidden.dedup();
    let gemms = GemmKernel::ALL
        .into_iter()
        .filter(|k| k.runs_on(arch))
        .flat_map(|k| {
            let combined = matches!(k, GemmKernel::Sm90 { .. });
            [Dtype::Bf16, Dtype::F16].into_iter().flat_map(move |d| {
                std::iter::once(k.spec(d)).chain(combined.then(|| k.spec_combined(d)))
            })
        });
    let major = if arch == "sm_90a" { 9 } else { 8 };
    let reduces = [2, 4, 8].into_iter().flat_map(move |r| {
        [
            peer_reduce_spec(Dtype::Bf16, r, major),
            peer_reduce_spec(Dtype::F16, r, major),
        ]
    });
    let runs = GemmKernel::Sm80.runs_on(arch);
    let mut widths: Vec<(u32, u32)> = GemmKernel::ALL
        .into_iter()
        .filter(|k| k.runs_on(arch))
        .map(|k| (k.tile().0, k.tile().1))
        .collect();
    widths.dedup();
    let unreorders = widths.into_iter().map(|(bm, bn)| unreorder_spec(bm, bn));
    // One kernel per compiled shape (configs that differ in stages alone
    // share it); the ring only where it runs, and the default on plain
    // loads everywhere (gemm_all_reduce_rmsnorm's calls).
    let hopper = arch == "sm_90a";
    let mut shapes: Vec<NormConfig> = NormConfig::SWEEP
        .iter()
        .chain([NormConfig::PLAIN].iter())
        .map(|&c| NormConfig {
            ring: c.ring && hopper,
            ..c
        })
        .collect();
    shapes.sort_by_key(|c| (c.threads, c.unroll, c.ring));
    shapes.dedup_by_key(|c| (c.threads, c.unroll, c.ring));
    // The kernels compiled for a hidden size: the watched kernel's own path in
    // each ring shape, and the one-shot entries of the default's plain shape
    // (the one its one-shot calls build; the entries share the module).
    let default = NormConfig::DEFAULT;
    let mut sized = Vec::new();
    for d in [Dtype::Bf16, Dtype::F16] {
        for &c in &shapes {
            let entry = if c.ring {
                NormEntry::CopyEngineWatch
            } else if (c.threads, c.unroll) == (default.threads, default.unroll) {
                NormEntry::OneshotStoreHidden
            } else {
                continue;
            };
            sized.extend(
                hidden
                    .iter()
                    .map(|&h| for_hidden(allreduce_rmsnorm_entry_spec(d, c, entry), h)),
            );
        }
    }
    let norms = [Dtype::Bf16, Dtype::F16]
        .into_iter()
        .flat_map(|d| {
            std::iter::once(add_rmsnorm_spec(d))
                .chain(shapes.iter().map(move |&c| allreduce_rmsnorm_spec(d, c)))
        })
        .chain(sized)
        .filter(move |_| runs);
    gemms
        .chain(reduces.filter(|_| runs))
        .chain(unreorders)
        .chain(norms)
        .collect()
}

/// The cubin of `spec` for `arch` (e.g. "sm_90a"), from the cache or NVRTC.
pub fn cubin(spec: &KernelSpec, arch: &str) -> Result<Vec<u8>> {
    let (major, minor) = nvrtc::version()?;
    let options = spec.options(arch);
    let main = spec.main();
    let mut parts: Vec<&[u8]> = vec![main.text.as_bytes()];
    parts.extend(HEADERS.iter().map(|h| h.text.as_bytes()));
    let joined = options.join(" ");
    let version = format!("nvrtc {major}.{minor}");
    parts.push(joined.as_bytes());
    parts.push(version.as_bytes());
    parts.push(arch.as_bytes());
    let key = cache::key(&parts);
    cache::get_or_compile(&key, || nvrtc::compile(&main, HEADERS, &options))
}

/// A kernel loaded into a device's primary context. Modules stay loaded for
/// the life of the process (as torch's own kernels do).
#[derive(Debug, Clone, Copy)]
pub struct Kernel {
    function: usize,
    pub dynamic_smem: u32,
}

static LOADED: Mutex<Option<HashMap<(i32, KernelSpec), Kernel>>> = Mutex::new(None);

/// Loads (once per device) and returns the kernel. Getting the function
/// handle loads it eagerly, which must happen before any stream wait that
/// its launch could otherwise deadlock behind under lazy module loading.
pub fn load(device: &DeviceInfo, spec: &KernelSpec) -> Result<Kernel> {
    let key = (device.ordinal, spec.clone());
    if let Some(k) = LOADED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .get(&key)
    {
        return Ok(*k);
    }
    let image = cubin(spec, &device.arch())?;
    let entry = CString::new(spec.entry).expect("entry names have no NUL");
    let mut module: sys::CUmodule = std::ptr::null_mut();
    let mut function: sys::CUfunction = std::ptr::null_mut();
    // SAFETY: image is a complete cubin; out pointers are valid.
    unsafe {
        check(
            sys::cuModuleLoadData(&mut module, image.as_ptr().cast()),
            "cuModuleLoadData",
        )?;
        check(
            sys::cuModuleGetFunction(&mut function, module, entry.as_ptr()),
            "cuModuleGetFunction",
        )?;
        check(
            sys::cuFuncSetAttribute(
                function,
                sys::CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                spec.dynamic_smem as i32,
            ),
            "cuFuncSetAttribute",
        )?;
    }
    let kernel = Kernel {
        function: function as usize,
        dynamic_smem: spec.dynamic_smem,
    };
    LOADED
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .get_or_insert_with(HashMap::new)
        .insert(key, kernel);
    Ok(kernel)
}

impl Kernel {
    /// Enqueues the kernel; `params` point at each argument, in order.
    pub fn launch(
        &self,
        grid: u32,
        block: u32,
        stream: RawStream,
        params: &mut [*mut c_void],
    ) -> Result<()> {
        // SAFETY: the caller passes one pointer per kernel parameter, live for this call.
        check(
            unsafe {
                sys::cuLaunchKernel(
                    self.function as sys::CUfunction,
                    grid,
                    1,
                    1,
                    block,
                    1,
                    1,
                    self.dynamic_smem,
                    stream,
                    params.as_mut_ptr(),
                    std::ptr::null_mut(),
                )
            },
            "cuLaunchKernel",
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn norm_configs_are_whole_warps_and_few_vectors() {
        assert_eq!(NormConfig::new(512, 4, 8).unwrap(), NormConfig::PLAIN);
        assert_eq!(NormConfig::SWEEP[0], NormConfig::DEFAULT);
        for (threads, unroll, stages) in [
            (96, 2, 1),
            (2048, 2, 1),
            (384, 2, 1),
            (256, 3, 1),
            (256, 0, 1),
            (256, 16, 1),
            (256, 2, 0),
            (256, 2, 17),
        ] {
            let err = NormConfig::new(threads, unroll, stages)
                .unwrap_err()
                .to_string();
            assert!(err.contains("config"), "{err}");
        }
        // Distinct configs; the stages are a launch parameter, so configs that differ
        // only there share a compiled kernel.
        let configs: std::collections::HashSet<_> = NormConfig::SWEEP.iter().collect();
        assert_eq!(configs.len(), NormConfig::SWEEP.len());
        let spec = |c: NormConfig| allreduce_rmsnorm_spec(Dtype::Bf16, c).defines;
        assert_eq!(spec(NormConfig::SWEEP[1]), spec(NormConfig::PLAIN));
        assert_ne!(spec(NormConfig::SWEEP[3]), spec(NormConfig::PLAIN));
        // The ring is its own kernel, with its shared memory; never one-shot.
        let ring = allreduce_rmsnorm_spec(Dtype::Bf16, NormConfig::DEFAULT);
        assert_ne!(ring.defines, spec(NormConfig::PLAIN));
        assert_eq!(ring.dynamic_smem, NORM_RING_BYTES);
        assert_eq!(
            allreduce_rmsnorm_spec(Dtype::Bf16, NormConfig::PLAIN).dynamic_smem,
            0
        );
        assert!(NormConfig::PLAIN.is_default() && NormConfig::DEFAULT.is_default());
        assert!(!NormConfig::SWEEP[1].is_default());
        assert!(all_for("sm_90a").contains(&allreduce_rmsnorm_spec(Dtype::Bf16, NormConfig::PLAIN)));
        assert!(all_for("sm_80").contains(&allreduce_rmsnorm_spec(Dtype::Bf16, NormConfig::PLAIN)));
        // The compile check builds the one-shot entries of a hidden size on every arch.
        for arch in ["sm_80", "sm_90a"] {
            for h in CHECKED_HIDDEN {
                let built = for_hidden(
                    allreduce_rmsnorm_entry_spec(
                        Dtype::F16,
                        NormConfig::PLAIN,
                        NormEntry::OneshotStoreHidden,
                    ),
                    h,
                );
                assert!(all_for(arch).contains(&built), "{arch} {h}");
            }
        }
        assert_eq!(
            all_with_hidden("sm_80", &[8192, 4096, 8192]),
            all_with_hidden("sm_80", &[4096, 8192])
        );
        let oneshot = NormConfig::with(512, 4, 4, true).unwrap();
        assert!(oneshot.ringed(true).is_err());
        assert!(oneshot.ringed(false).is_ok());
        assert!(NormConfig::new(1024, 4, 8).unwrap().ringed(true).is_err());
        assert!(all_for("sm_90a").contains(&ring));
        assert!(!all_for("sm_80").contains(&ring));
        assert!(NormConfig::DEFAULT.ringed(false).unwrap() == NormConfig::PLAIN);
        // The launch's extra warp is the kernel's producer.
        let source = include_str!("../../csrc/allreduce_rmsnorm.cu");
        assert!(source.contains(&format!(
            "constexpr int PRODUCER = {NORM_PRODUCER_THREADS};"
        )));
        assert_eq!(
            NormConfig::DEFAULT.block_threads(),
            512 + NORM_PRODUCER_THREADS
        );
        assert_eq!(NormConfig::PLAIN.block_threads(), 512);
    }

    #[test]
    fn extra_nvrtc_options_split_on_whitespace() {
        assert!(extra_options(None).is_empty());
        assert!(extra_options(Some("  ")).is_empty());
        assert_eq!(
            extra_options(Some(" -lineinfo\t-DFOO=1 ")),
            vec!["-lineinfo".to_string(), "-DFOO=1".to_string()]
        );
    }
}
