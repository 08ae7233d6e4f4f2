//! The whole plan the op enqueues for one GEMM + AllReduce: how many CTAs
//! the GEMM gets, which tiles signal which group, and whether to overlap at
//! all, decided from the predictor so small or comm-light shapes fall back
//! to running the two back to back.

mod describe;

use crate::plan::error::{require_positive, PlanError};
use crate::plan::groups::{GroupPartition, Partition};
use crate::plan::order::{default_raster_bands, TileOrder};
use crate::plan::predictor::{
    best_partition, best_staged_partition, predict, predict_sequential, HardwareModel, Timeline,
};
use crate::plan::staged::staging_elems;
use crate::plan::tiles::{OutputTiles, TileShape};
use crate::plan::waves::Waves;

/// Auto overlaps only where the prediction beats running back to back by 4%:
/// on 2x H200 the model's error is within about 5% either way, and a shape
/// that overlap barely wins on paper must not lose in practice.
pub const AUTO_OVERLAP_MARGIN: f64 = 0.96;

/// Auto takes the swizzled order only where it is predicted 3% faster than
/// the banded one: its un-reorder copy reads and writes the output once more
/// beside the GEMM, HBM traffic the model does not charge to the GEMM.
pub const AUTO_SWIZZLED_MARGIN: f64 = 0.97;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeRequest {
    /// Overlap only where the predictor says it is faster.
    Auto,
    Overlap,
    Sequential,
}

/// Which tile order and group layout an overlapped plan may use.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OrderRequest {
    /// Swizzled where the predictor says it is faster by AUTO_SWIZZLED_MARGIN, else banded.
    Auto,
    /// Groups of whole row bands, rastered inside each group, reduced in place.
    Banded,
    /// One raster over the whole output, groups of whole waves reduced in a
    /// staging buffer and un-reordered into `out` (FlashOverlap's reordering).
    Swizzled,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// GEMM on the unreserved SMs, each group reduced as soon as it is stored.
    Overlap,
    /// GEMM on all SMs, then one AllReduce of the whole output.
    Sequential,
}

impl Schedule {
    /// The predicted time of this schedule: the overlapped one's with the
    /// per-call cost (`fixed_us`) its groups do not show, or the sequential one's.
    pub fn predicted_us(self, timeline: &Timeline, fixed_us: f64) -> f64 {
        match self {
            Schedule::Overlap => timeline.overlap_us + fixed_us,
            Schedule::Sequential => timeline.sequential_us,
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct PlanRequest {
    pub m: u32,
    pub n: u32,
    pub k: u32,
    pub world: u32,
    pub elem_bytes: u32,
    pub tile: TileShape,
    /// SMs left to the collective's CTAs while overlapping.
    pub reserved_sms: u32,
    /// Forces uniform groups of this many row bands instead of the searched layout.
    pub bands_per_group: Option<u32>,
    /// Cap on the searched layout's group count.
    pub max_groups: u32,
    pub mode: ModeRequest,
    /// Row bands per raster block inside each group (1: row-band order);
    /// None: `default_raster_bands` for the overlap's CTAs.
    pub raster_bands: Option<u32>,
    pub order: OrderRequest,
}

/// The checks every GEMM + collective request shares: positive dimensions,
/// a valid machine, SMs left to the GEMM, positive group limits.
pub(crate) fn validate_common(
    dims: [(&str, u32); 5],
    hw: &HardwareModel,
    reserved_sms: u32,
    max_groups: u32,
    bands_per_group: Option<u32>,
) -> Result<(), PlanError> {
    for (field, value) in dims {
        require_positive(field, value, PlanError::InvalidShape)?;
    }
    hw.validate()?;
    if reserved_sms >= hw.sms {
        return Err(PlanError::InvalidHardware(format!(
            "reserved_sms must be < sms = {}, got {reserved_sms}",
            hw.sms
        )));
    }
    require_positive("max_groups", max_groups, PlanError::InvalidPartition)?;
    if let Some(bands) = bands_per_group {
        require_positive("bands_per_group", bands, PlanError::InvalidPartition)?;
    }
    Ok(())
}

impl PlanRequest {
    fn validate(&self, hw: &HardwareModel) -> Result<(), PlanError> {
        let dims = [
            ("m", self.m),
            ("n", self.n),
            ("k", self.k),
            ("world", self.world),
            ("elem_bytes", self.elem_bytes),
        ];
        validate_common(
            dims,
            hw,
            self.reserved_sms,
            self.max_groups,
            self.bands_per_group,
        )?;
        if let Some(bands) = self.raster_bands {
            require_positive("raster_bands", bands, PlanError::InvalidPartition)?;
        }
        if self.bands_per_group.is_some() && self.order == OrderRequest::Swizzled {
            return Err(PlanError::InvalidPartition(
                "bands_per_group sets whole-band groups, which the swizzled order does not have; \
                 leave it unset or use the banded order"
                    .into(),
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct GemmAllReducePlan {
    pub request: PlanRequest,
    pub tiles: OutputTiles,
    pub schedule: Schedule,
    pub ctas: u32,
    pub waves: Waves,
    pub order: TileOrder,
    pub partition: Partition,
    /// Group id per position of `order`, uploaded for the kernel.
    pub tile_group: Vec<u32>,
    pub timeline: Timeline,
    /// The hardware's per-call cost of overlapping (`overlap_fixed_us`).
    pub overlap_fixed_us: f64,
}

/// Validates (m,n,k >= 1, world >= 1, reserved_sms < hw.sms, max_groups >= 1,
/// bands_per_group >= 1 if set, and not with the swizzled order). ctas =
/// hw.sms - reserved_sms for Overlap, hw.sms for Sequential. Overlap
/// partition = uniform(bands_per_group) if given, else the best of
/// best_partition (banded) and best_staged_partition (swizzled) that the
/// order request allows. Sequential plan: a single in-place group covering
/// every band and ctas = hw.sms. Auto picks Overlap only on more than one rank
/// and when its predicted overlap_us + overlap_fixed_us < AUTO_OVERLAP_MARGIN *
/// sequential_us, and a
/// forced bands_per_group implies Overlap unless mode is Sequential.
/// timeline is always filled (for Sequential: the single group's timing
/// under the sequential model).
pub fn plan_gemm_all_reduce(
    req: &PlanRequest,
    hw: &HardwareModel,
) -> Result<GemmAllReducePlan, PlanError> {
    req.validate(hw)?;
    let tiles = OutputTiles::new(req.m, req.n, req.tile)?;
    let overlap_ctas = hw.sms - req.reserved_sms;
    let (k, world, elem) = (req.k, req.world, req.elem_bytes);
    let overlap = match (req.mode, req.bands_per_group) {
        (ModeRequest::Sequential, _) => None,
        (_, Some(bands)) => {
            let partition = GroupPartition::uniform(&tiles, bands)?;
            let timeline = predict(&tiles, k, overlap_ctas, &partition, hw, world, elem)?;
            Some((Partition::InPlace(partition), timeline))
        }
        (mode, None) => {
            let mut best: Option<(Partition, Timeline)> = None;
            if req.order != OrderRequest::Swizzled {
                let (p, t) =
                    best_partition(&tiles, k, overlap_ctas, hw, world, elem, req.max_groups)?;
                best = Some((Partition::InPlace(p), t));
            }
            if req.order != OrderRequest::Banded {
                let (p, t) = best_staged_partition(
                    &tiles,
                    k,
                    overlap_ctas,
                    hw,
                    world,
                    elem,
                    req.max_groups,
                )?;
                let margin = match req.order {
                    OrderRequest::Auto => AUTO_SWIZZLED_MARGIN,
                    _ => 1.0,
                };
                if best
                    .as_ref()
                    .map_or(true, |(_, b)| t.overlap_us < margin * b.overlap_us)
                {
                    best = Some((Partition::Staged(p), t));
                }
            }
            let best = best.expect("some order is always allowed");
            // One rank communicates nothing: overlap could only hide a fused
            // norm behind a GEMM that lost SMs, which measured slower on all 5
            // shapes where the model said otherwise (world-1 E2 on H200).
            let pays = world > 1
                && best.1.overlap_us + hw.overlap_fixed_us
                    < AUTO_OVERLAP_MARGIN * best.1.sequential_us;
            (mode == ModeRequest::Overlap || pays).then_some(best)
        }
    };
    let (schedule, ctas, partition, timeline) = match overlap {
        Some((partition, timeline)) => (Schedule::Overlap, overlap_ctas, partition, timeline),
        None => (
            Schedule::Sequential,
            hw.sms,
            Partition::InPlace(GroupPartition::whole(&tiles)),
            predict_sequential(&tiles, k, hw, world, elem)?,
        ),
    };
    let raster = req
        .raster_bands
        .unwrap_or_else(|| default_raster_bands(&tiles, overlap_ctas));
    let (order, tile_group) = match &partition {
        Partition::InPlace(p) => {
            let order = TileOrder::rastered(&tiles, &p.band_counts(), raster)?;
            let groups = order.by_position(&p.tile_group_table(&tiles));
            (order, groups)
        }
        Partition::Staged(p) => (TileOrder::swizzled(&tiles, raster)?, p.group_by_position()),
    };
    Ok(GemmAllReducePlan {
        request: req.clone(),
        schedule,
        ctas,
        waves: Waves::new(ctas, tiles.count())?,
        tile_group,
        order,
        partition,
        timeline,
        tiles,
        // A sequential call forks nothing: its one schedule costs what it
        // predicts.
        overlap_fixed_us: match schedule {
            Schedule::Overlap => hw.overlap_fixed_us,
            Schedule::Sequential => 0.0,
        },
    })
}

impl GemmAllReducePlan {
    /// What the call is predicted to take on the schedule chosen.
    pub fn predicted_us(&self) -> f64 {
        self.schedule
            .predicted_us(&self.timeline, self.overlap_fixed_us)
    }

    /// Row bands per raster block of the tile order (1: row by row).
    pub fn raster_bands(&self) -> u32 {
        self.order.raster_bands()
    }

    /// Elements of the staging buffer the plan needs (0: in place).
    pub fn staging_elems(&self) -> u64 {
        if self.partition.is_staged() {
            staging_elems(&self.tiles)
        } else {
            0
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::plan::predictor::{FUSED_NORM_CAP, FUSED_NORM_LAUNCH_US};
    use crate::plan::testing::{request, world};

    fn assert_consistent(plan: &GemmAllReducePlan) {
        let tiles = &plan.tiles;
        assert_eq!(plan.waves, Waves::new(plan.ctas, tiles.count()).unwrap());
        match &plan.partition {
            Partition::InPlace(p) => {
                let order = TileOrder::rastered(tiles, &p.band_counts(), plan.raster_bands());
                assert_eq!(plan.order, order.unwrap());
                assert!(p.check_against(tiles).is_ok());
                let by_tile = p.tile_group_table(tiles);
                assert_eq!(plan.tile_group, plan.order.by_position(&by_tile));
                assert_eq!(plan.staging_elems(), 0);
            }
            Partition::Staged(p) => {
                assert_eq!(plan.schedule, Schedule::Overlap);
                let order = TileOrder::swizzled(tiles, plan.raster_bands()).unwrap();
                assert_eq!(plan.order, order);
                assert_eq!(plan.tile_group, p.group_by_position());
                assert_eq!(plan.staging_elems(), staging_elems(tiles));
                // Every group starts on a wave boundary.
                assert!(p.groups.iter().all(|g| g.positions.start % plan.ctas == 0));
            }
        }
        // Groups are signalled in order: the group id never decreases along positions.
        assert!(plan.tile_group.windows(2).all(|w| w[0] <= w[1]));
        assert_eq!(plan.timeline.groups.len(), plan.partition.len());
        assert!(plan.partition.len() as u32 <= plan.request.max_groups);
    }

    #[test]
    fn every_world_size_plans() {
        let hw = HardwareModel::h200();
        for world in [2, 4, 8] {
            for mode in [
                ModeRequest::Auto,
                ModeRequest::Overlap,
                ModeRequest::Sequential,
            ] {
                let req = PlanRequest {
                    mode,
                    ..request(8192, 8192, 8192, world)
                };
                let plan = plan_gemm_all_reduce(&req, &hw).unwrap();
                assert_consistent(&plan);
                if mode == ModeRequest::Overlap {
                    assert_eq!(plan.schedule, Schedule::Overlap);
                    assert_eq!(plan.ctas, hw.sms - req.reserved_sms);
                }
            }
        }
    }

    #[test]
    fn large_shapes_overlap_under_auto_when_the_kernel_matches_the_library() {
        let hw = HardwareModel {
            gemm_tflops: 720.0,
            ..HardwareModel::h200()
        };
        let plan = plan_gemm_all_reduce(&request(16384, 8192, 4096, 8), &hw).unwrap();
        assert_eq!(plan.schedule, Schedule::Overlap);
        assert!(plan.partition.len() > 1);
        assert!(plan.timeline.overlap_us < plan.timeline.sequential_us);
    }

    #[test]
    fn auto_falls_back_when_the_signaling_kernel_is_much_slower_than_the_library() {
        let hw = HardwareModel {
            gemm_tflops: 100.0,
            sequential_gemm_tflops: 800.0,
            ..HardwareModel::h200()
        };
        let plan = plan_gemm_all_reduce(&request(16384, 8192, 4096, 2), &hw).unwrap();
        assert_eq!(plan.schedule, Schedule::Sequential);
        assert_eq!(plan.partition.len(), 1);
    }

    #[test]
    fn forced_sequential_is_one_group_on_every_sm() {
        let hw = HardwareModel::h200();
        let req = PlanRequest {
            mode: ModeRequest::Sequential,
            bands_per_group: Some(2),
            ..request(16384, 8192, 4096, 8)
        };
        let plan = plan_gemm_all_reduce(&req, &hw).unwrap();
        assert_eq!(plan.schedule, Schedule::Sequential);
        assert_eq!(plan.ctas, hw.sms);
        assert_eq!(
            plan.partition,
            Partition::InPlace(GroupPartition::whole(&plan.tiles))
        );
        assert_eq!(plan.partition.collectives()[0].slice.count, 16384 * 8192);
        assert!(plan.tile_group.iter().all(|&g| g == 0));
        assert_eq!(plan.timeline.overlap_us, plan.timeline.sequential_us);
        assert_consistent(&plan);
    }

    #[test]
    fn forced_bands_per_group_overlaps_under_auto() {
        // Tiny: Auto alone would not overlap it.
        let req = PlanRequest {
            bands_per_group: Some(1),
            ..request(512, 512, 64, 2)
        };
        let plan = plan_gemm_all_reduce(&req, &HardwareModel::h200()).unwrap();
        assert_eq!(plan.schedule, Schedule::Overlap);
        assert_eq!(
            plan.partition,
            Partition::InPlace(GroupPartition::uniform(&plan.tiles, 1).unwrap())
        );
        let auto = plan_gemm_all_reduce(&request(512, 512, 64, 2), &HardwareModel::h200()).unwrap();
        assert_eq!(auto.schedule, Schedule::Sequential);
    }

    #[test]
    fn swizzled_plans_stage_whole_waves() {
        let hw = HardwareModel::h200();
        let req = PlanRequest {
            mode: ModeRequest::Overlap,
            order: OrderRequest::Swizzled,
            raster_bands: None,
            ..request(8192, 8192, 4096, 2)
        };
        let plan = plan_gemm_all_reduce(&req, &hw).unwrap();
        assert!(plan.partition.is_staged());
        assert_eq!(
            plan.order.kind,
            crate::plan::OrderKind::Swizzled {
                bands: default_raster_bands(&plan.tiles, plan.ctas)
            }
        );
        assert_consistent(&plan);
        // The staged groups' timeline is what predict_staged says.
        let Partition::Staged(p) = &plan.partition else {
            unreachable!()
        };
        let again =
            crate::plan::predict_staged(&plan.tiles, req.k, plan.ctas, p, &hw, 2, 2).unwrap();
        assert_eq!(plan.timeline, again);
        // Sequential stays in place whatever the order.
        let seq = PlanRequest {
            mode: ModeRequest::Sequential,
            ..req.clone()
        };
        assert!(!plan_gemm_all_reduce(&seq, &hw)
            .unwrap()
            .partition
            .is_staged());
        // Forced bands cannot be swizzled.
        let forced = PlanRequest {
            bands_per_group: Some(2),
            ..req
        };
        let err = plan_gemm_all_reduce(&forced, &hw).unwrap_err();
        assert!(err.to_string().contains("bands_per_group"), "{err}");
    }

    #[test]
    fn auto_order_picks_the_faster_prediction() {
        let base = PlanRequest {
            mode: ModeRequest::Overlap,
            ..request(16384, 8192, 4096, 2)
        };
        for unreorder in [1.0, 1e9] {
            let hw = HardwareModel {
                unreorder_bytes_per_us_per_sm: unreorder,
                ..HardwareModel::h200()
            };
            let plan = |order| {
                plan_gemm_all_reduce(
                    &PlanRequest {
                        order,
                        ..base.clone()
                    },
                    &hw,
                )
                .unwrap()
            };
            let (auto, banded, swizzled) = (
                plan(OrderRequest::Auto),
                plan(OrderRequest::Banded),
                plan(OrderRequest::Swizzled),
            );
            let (b, s) = (banded.timeline.overlap_us, swizzled.timeline.overlap_us);
            let expected = if s < AUTO_SWIZZLED_MARGIN * b { s } else { b };
            assert_eq!(auto.timeline.overlap_us, expected);
            assert_consistent(&auto);
            // A copy slower than anything never wins; a free one ties or wins.
            if unreorder == 1.0 {
                assert!(!auto.partition.is_staged());
            } else {
                assert!(swizzled.timeline.overlap_us <= banded.timeline.overlap_us * 1.001);
            }
        }
    }

    #[test]
    fn a_fused_norm_is_charged_to_every_group_the_last_on_every_sm_and_to_the_baseline() {
        let plain = HardwareModel::h200();
        let normed = HardwareModel {
            fused_norm_bytes_per_us_per_sm: 12_000.0,
            ..plain
        };
        let req = PlanRequest {
            mode: ModeRequest::Overlap,
            bands_per_group: Some(4),
            ..request(4096, 8192, 4096, 2)
        };
        let (a, b) = (
            plan_gemm_all_reduce(&req, &plain).unwrap(),
            plan_gemm_all_reduce(&req, &normed).unwrap(),
        );
        // 4 bands of 8192 bf16 columns on the 12 reserved SMs after each
        // collective; after the last one the GEMM is done: every SM, but
        // one CTA per 16 rows (the kernel's warp per row) gives its 512 rows 32.
        let group_bytes = (4 * 128 * 8192 * 2) as f64;
        let last = b.timeline.groups.len() - 1;
        for (g, (x, y)) in a.timeline.groups.iter().zip(&b.timeline.groups).enumerate() {
            let (tx, ty) = (
                x.comm_end_us - x.comm_start_us,
                y.comm_end_us - y.comm_start_us,
            );
            let rate = if g == last {
                12_000.0 * 32.0
            } else {
                12_000.0 * 12.0
            };
            assert!(
                (ty - tx - FUSED_NORM_LAUNCH_US - group_bytes / rate).abs() < 1e-6,
                "{g}: {tx} {ty}"
            );
        }
        let whole = FUSED_NORM_LAUNCH_US
            + (4096 * 8192 * 2) as f64 / (12_000.0f64 * 132.0).min(FUSED_NORM_CAP);
        assert!((b.timeline.sequential_us - a.timeline.sequential_us - whole).abs() < 1e-6);
    }

    #[test]
    fn invalid_requests_name_the_field() {
        let hw = HardwareModel::h200();
        let base = request(1024, 1024, 1024, 2);
        let cases = [
            (
                PlanRequest {
                    m: 0,
                    ..base.clone()
                },
                "m ",
            ),
            (
                PlanRequest {
                    n: 0,
                    ..base.clone()
                },
                "n ",
            ),
            (
                PlanRequest {
                    k: 0,
                    ..base.clone()
                },
                "k ",
            ),
            (
                PlanRequest {
                    world: 0,
                    ..base.clone()
                },
                "world",
            ),
            (
                PlanRequest {
                    elem_bytes: 0,
                    ..base.clone()
                },
                "elem_bytes",
            ),
            (
                PlanRequest {
                    tile: TileShape { bm: 0, ..base.tile },
                    ..base.clone()
                },
                "tile.bm",
            ),
            (
                PlanRequest {
                    reserved_sms: 132,
                    ..base.clone()
                },
                "reserved_sms",
            ),
            (
                PlanRequest {
                    max_groups: 0,
                    ..base.clone()
                },
                "max_groups",
            ),
            (
                PlanRequest {
                    bands_per_group: Some(0),
                    ..base.clone()
                },
                "bands_per_group",
            ),
        ];
        for (req, field) in cases {
            let err = plan_gemm_all_reduce(&req, &hw).unwrap_err();
            let why = match &err {
                PlanError::InvalidShape(why)
                | PlanError::InvalidPartition(why)
                | PlanError::InvalidHardware(why) => why,
            };
            assert!(why.starts_with(field), "{field}: {err}");
        }
        let broken = HardwareModel {
            gemm_tflops: -1.0,
            ..hw
        };
        assert!(matches!(
            plan_gemm_all_reduce(&base, &broken),
            Err(PlanError::InvalidHardware(_))
        ));
    }

    proptest! {
        #[test]
        fn auto_never_predicts_slower_than_sequential(
            m in 1u32..20000,
            n8 in 1u32..=2500,
            k in 1u32..16384,
            world in world(),
            reserved_sms in 0u32..64,
            order in prop::sample::select(vec![OrderRequest::Auto, OrderRequest::Banded, OrderRequest::Swizzled]),
        ) {
            let req = PlanRequest { reserved_sms, order, ..request(m, n8 * 8, k, world) };
            let plan = plan_gemm_all_reduce(&req, &HardwareModel::h200()).unwrap();
            assert_consistent(&plan);
            prop_assert!(plan.timeline.overlap_us <= plan.timeline.sequential_us);
            if plan.schedule == Schedule::Overlap {
                prop_assert!(plan.timeline.overlap_us < plan.timeline.sequential_us);
            }
        }
    }
}
