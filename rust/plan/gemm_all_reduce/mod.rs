//! The whole plan the op enqueues for one GEMM + AllReduce: how many CTAs
//! the GEMM gets, which tiles signal which group, and whether to overlap at
//! all, decided from the predictor so small or comm-light shapes fall back
//! to running the two back to back.

mod describe;

use crate::plan::error::{require_positive, PlanError};
use crate::plan::groups::GroupPartition;
use crate::plan::order::{default_raster_bands, OrderKind, TileOrder};
use crate::plan::predictor::{
    best_partition, predict, predict_sequential, HardwareModel, Timeline,
};
use crate::plan::tiles::{OutputTiles, TileShape};
use crate::plan::waves::Waves;

/// Auto overlaps only where the prediction beats running back to back by 4%:
/// on 2x H200 the model's error is within about 5% either way, and a shape
/// that overlap barely wins on paper must not lose in practice.
pub const AUTO_OVERLAP_MARGIN: f64 = 0.96;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ModeRequest {
    /// Overlap only where the predictor says it is faster.
    Auto,
    Overlap,
    Sequential,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Schedule {
    /// GEMM on the unreserved SMs, each group reduced as soon as it is stored.
    Overlap,
    /// GEMM on all SMs, then one AllReduce of the whole output.
    Sequential,
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
}

impl PlanRequest {
    fn validate(&self, hw: &HardwareModel) -> Result<(), PlanError> {
        for (field, value) in [
            ("m", self.m),
            ("n", self.n),
            ("k", self.k),
            ("world", self.world),
            ("elem_bytes", self.elem_bytes),
        ] {
            require_positive(field, value, PlanError::InvalidShape)?;
        }
        hw.validate()?;
        if self.reserved_sms >= hw.sms {
            return Err(PlanError::InvalidHardware(format!(
                "reserved_sms must be < sms = {}, got {}",
                hw.sms, self.reserved_sms
            )));
        }
        require_positive("max_groups", self.max_groups, PlanError::InvalidPartition)?;
        if let Some(bands) = self.raster_bands {
            require_positive("raster_bands", bands, PlanError::InvalidPartition)?;
        }
        if let Some(bands) = self.bands_per_group {
            require_positive("bands_per_group", bands, PlanError::InvalidPartition)?;
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
    pub partition: GroupPartition,
    /// Group id per position of `order`, uploaded for the kernel.
    pub tile_group: Vec<u32>,
    pub timeline: Timeline,
}

/// Validates (m,n,k >= 1, world >= 1, reserved_sms < hw.sms, max_groups >= 1,
/// bands_per_group >= 1 if set). ctas = hw.sms - reserved_sms for Overlap,
/// hw.sms for Sequential. Overlap partition = uniform(bands_per_group) if
/// given, else best_partition. Sequential plan: a single group covering every
/// band and ctas = hw.sms. Auto picks Overlap only when its predicted
/// overlap_us < AUTO_OVERLAP_MARGIN * sequential_us, and a forced bands_per_group implies
/// Overlap unless mode is Sequential. timeline is always filled (for
/// Sequential: the single group's timing under the sequential model).
pub fn plan_gemm_all_reduce(
    req: &PlanRequest,
    hw: &HardwareModel,
) -> Result<GemmAllReducePlan, PlanError> {
    req.validate(hw)?;
    let tiles = OutputTiles::new(req.m, req.n, req.tile)?;
    let overlap_ctas = hw.sms - req.reserved_sms;
    let overlap = match (req.mode, req.bands_per_group) {
        (ModeRequest::Sequential, _) => None,
        (_, Some(bands)) => {
            let partition = GroupPartition::uniform(&tiles, bands)?;
            let timeline = predict(
                &tiles,
                req.k,
                overlap_ctas,
                &partition,
                hw,
                req.world,
                req.elem_bytes,
            )?;
            Some((partition, timeline))
        }
        (mode, None) => {
            let best = best_partition(
                &tiles,
                req.k,
                overlap_ctas,
                hw,
                req.world,
                req.elem_bytes,
                req.max_groups,
            )?;
            let pays = best.1.overlap_us + hw.overlap_fixed_us
                < AUTO_OVERLAP_MARGIN * best.1.sequential_us;
            (mode == ModeRequest::Overlap || pays).then_some(best)
        }
    };
    let (schedule, ctas, partition, timeline) = match overlap {
        Some((partition, timeline)) => (Schedule::Overlap, overlap_ctas, partition, timeline),
        None => (
            Schedule::Sequential,
            hw.sms,
            GroupPartition::whole(&tiles),
            predict_sequential(&tiles, req.k, hw, req.world, req.elem_bytes)?,
        ),
    };
    let raster = req
        .raster_bands
        .unwrap_or_else(|| default_raster_bands(&tiles, overlap_ctas));
    let order = TileOrder::rastered(&tiles, &partition.band_counts(), raster)?;
    Ok(GemmAllReducePlan {
        request: req.clone(),
        schedule,
        ctas,
        waves: Waves::new(ctas, tiles.count())?,
        tile_group: order.by_position(&partition.tile_group_table(&tiles)),
        order,
        partition,
        timeline,
        tiles,
    })
}

impl GemmAllReducePlan {
    /// Row bands per raster block of the tile order (1: row by row).
    pub fn raster_bands(&self) -> u32 {
        match self.order.kind {
            OrderKind::RowBand => 1,
            OrderKind::Rastered { bands } => bands,
        }
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::plan::testing::{request, world};

    fn assert_consistent(plan: &GemmAllReducePlan) {
        let tiles = &plan.tiles;
        assert_eq!(plan.waves, Waves::new(plan.ctas, tiles.count()).unwrap());
        let order = TileOrder::rastered(tiles, &plan.partition.band_counts(), plan.raster_bands());
        assert_eq!(plan.order, order.unwrap());
        assert!(plan.partition.check_against(tiles).is_ok());
        let by_tile = plan.partition.tile_group_table(tiles);
        assert_eq!(plan.tile_group, plan.order.by_position(&by_tile));
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
        assert_eq!(plan.partition, GroupPartition::whole(&plan.tiles));
        assert_eq!(plan.partition.groups[0].slice.count, 16384 * 8192);
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
        assert_eq!(plan.partition.band_counts(), [1, 1, 1, 1]);
        let auto = plan_gemm_all_reduce(&request(512, 512, 64, 2), &HardwareModel::h200()).unwrap();
        assert_eq!(auto.schedule, Schedule::Sequential);
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
        ) {
            let req = PlanRequest { reserved_sms, ..request(m, n8 * 8, k, world) };
            let plan = plan_gemm_all_reduce(&req, &HardwareModel::h200()).unwrap();
            assert_consistent(&plan);
            prop_assert!(plan.timeline.overlap_us <= plan.timeline.sequential_us);
            if plan.schedule == Schedule::Overlap {
                prop_assert!(plan.timeline.overlap_us < plan.timeline.sequential_us);
            }
        }
    }
}
