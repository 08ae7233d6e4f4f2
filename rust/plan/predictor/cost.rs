//! The per-group quantities of the model, shared by `predict` and the search
//! so that the optimum the search finds is exactly what `predict` reports.

use crate::plan::error::{require_positive, PlanError};
use crate::plan::tiles::OutputTiles;
use crate::plan::waves::Waves;

use super::hardware::HardwareModel;

pub(super) struct OverlapCost<'a> {
    tiles: &'a OutputTiles,
    hw: HardwareModel,
    waves: Waves,
    wave_us: f64,
    k: u32,
    world: u32,
    elem_bytes: u32,
}

impl<'a> OverlapCost<'a> {
    /// What each group adds that the pipeline does not hide.
    pub(super) fn group_us(&self) -> f64 {
        self.hw.overlap_group_us
    }

    pub(super) fn new(
        tiles: &'a OutputTiles,
        k: u32,
        ctas: u32,
        hw: &HardwareModel,
        world: u32,
        elem_bytes: u32,
    ) -> Result<Self, PlanError> {
        hw.validate()?;
        for (field, value) in [("k", k), ("world", world), ("elem_bytes", elem_bytes)] {
            require_positive(field, value, PlanError::InvalidShape)?;
        }
        if ctas > hw.sms {
            return Err(PlanError::InvalidHardware(format!(
                "ctas must be <= sms = {}, got {ctas}",
                hw.sms
            )));
        }
        let waves = Waves::new(ctas, tiles.count())?;
        // A wave of `ctas` full tiles runs at gemm_tflops * ctas / sms, so
        // ctas cancels: a wave lasts one tile's flops at one SM's share.
        let tile_flops = 2.0 * f64::from(tiles.tile.bm) * f64::from(tiles.tile.bn) * f64::from(k);
        let wave_us = tile_flops / (hw.gemm_tflops * 1e6 / f64::from(hw.sms));
        Ok(Self {
            tiles,
            hw: *hw,
            waves,
            wave_us,
            k,
            world,
            elem_bytes,
        })
    }

    pub(super) fn band_count(&self) -> u32 {
        self.tiles.tiles_m
    }

    /// When the overlapped GEMM has stored every tile of bands `0..end_band` (end_band >= 1).
    pub(super) fn gemm_done_us(&self, end_band: u32) -> f64 {
        let last_position = end_band * self.tiles.tiles_n - 1;
        let waves = self.waves.wave_of(last_position) + 1;
        f64::from(waves) * self.wave_us * self.hw.overlap_gemm_slowdown
    }

    /// When the overlapped GEMM has stored position `position` (and every
    /// position of the waves before it).
    pub(super) fn position_done_us(&self, position: u32) -> f64 {
        f64::from(self.waves.wave_of(position) + 1) * self.wave_us * self.hw.overlap_gemm_slowdown
    }

    pub(super) fn gemm_us(&self) -> f64 {
        f64::from(self.waves.count()) * self.wave_us * self.hw.overlap_gemm_slowdown
    }

    /// How the GEMM slows the collectives beside it (see [`Beside`]).
    pub(super) fn beside(&self) -> Beside {
        Beside::new(self.gemm_us(), self.hw.comm_beside_gemm)
    }

    /// AllReduce of group bands `bands` while overlapping (the overlap
    /// backend's model, under the overlap CTA cap), then the fused norm of
    /// its rows where one follows: on the SMs the GEMM leaves free, except
    /// after the last group, when the GEMM is done and the norm gets every SM.
    pub(super) fn comm_us(&self, bands: std::ops::Range<u32>) -> f64 {
        self.group_work(bands).total_us()
    }

    /// [`Self::comm_us`] in its two parts.
    pub(super) fn group_work(&self, bands: std::ops::Range<u32>) -> StreamWork {
        let tail = bands.end == self.band_count();
        let norm_sms = if tail { self.hw.sms } else { self.free_sms() };
        StreamWork {
            collective_us: self.link_us(bands.clone()),
            then_us: self.norm_us(bands, norm_sms),
        }
    }

    /// The collective of group bands `bands` alone (no norm), while overlapping.
    pub(super) fn link_us(&self, bands: std::ops::Range<u32>) -> f64 {
        let bytes = self.bytes(self.rows(bands));
        self.hw.overlap_comm_slowdown * self.hw.overlap_comm.time_us(bytes, self.world)
    }

    /// The fused norm of group bands `bands` on at most `sms` SMs (0 where
    /// no norm follows).
    pub(super) fn norm_us(&self, bands: std::ops::Range<u32>, sms: u32) -> f64 {
        let rows = self.rows(bands);
        self.hw.fused_norm_us(self.bytes(rows), rows, sms)
    }

    /// SMs the overlapped GEMM leaves free.
    pub(super) fn free_sms(&self) -> u32 {
        self.hw.sms.saturating_sub(self.waves.ctas)
    }

    /// Bytes of group bands `bands` (every column of the model's output).
    pub(super) fn group_bytes(&self, bands: std::ops::Range<u32>) -> u64 {
        self.bytes(self.rows(bands))
    }

    /// Staged schedule: when the GEMM has stored every position of waves `0..end_wave`.
    pub(super) fn staged_done_us(&self, end_wave: u32) -> f64 {
        f64::from(end_wave) * self.wave_us * self.hw.overlap_gemm_slowdown
    }

    pub(super) fn wave_count(&self) -> u32 {
        self.waves.count()
    }

    /// Staged schedule: positions in waves `start..end` (the last wave may be partial).
    pub(super) fn staged_tiles(&self, waves: std::ops::Range<u32>) -> u32 {
        self.waves.positions(waves.end - 1).end - self.waves.positions(waves.start).start
    }

    /// Staged schedule: the collective of `tiles` whole staged tiles, then
    /// their un-reorder copy into `out` on the SMs the GEMM leaves free
    /// (both on the communication stream).
    pub(super) fn staged_work(&self, tiles: u32) -> StreamWork {
        let staged = u64::from(tiles)
            * u64::from(self.tiles.tile.bm)
            * u64::from(self.tiles.tile.bn)
            * u64::from(self.elem_bytes);
        let collective =
            self.hw.overlap_comm_slowdown * self.hw.overlap_comm.time_us(staged, self.world);
        let free_sms = self.hw.sms.saturating_sub(self.waves.ctas).max(1);
        StreamWork {
            collective_us: collective,
            then_us: staged as f64 / (self.hw.unreorder_bytes_per_us_per_sm * f64::from(free_sms)),
        }
    }

    /// The library GEMM on all SMs with nothing beside it, then one
    /// AllReduce of all of `out`.
    pub(super) fn sequential_us(&self) -> f64 {
        let norm = self
            .hw
            .fused_norm_us(self.bytes(self.tiles.m), self.tiles.m, self.hw.sms);
        self.sequential_gemm_us() + self.collective_us(self.tiles.m) + norm
    }

    pub(super) fn sequential_gemm_us(&self) -> f64 {
        let flops = 2.0 * f64::from(self.tiles.m) * f64::from(self.tiles.n) * f64::from(self.k);
        flops / (self.hw.sequential_gemm_tflops * 1e6)
    }

    /// Rows of group bands `start..end`, the last band clipped to `m`.
    pub(super) fn rows(&self, bands: std::ops::Range<u32>) -> u32 {
        self.tiles.band_rows(bands.end - 1).end - self.tiles.band_rows(bands.start).start
    }

    fn collective_us(&self, rows: u32) -> f64 {
        self.hw.comm.time_us(self.bytes(rows), self.world)
    }

    fn bytes(&self, rows: u32) -> u64 {
        u64::from(rows) * u64::from(self.tiles.n) * u64::from(self.elem_bytes)
    }
}

/// A group's work on the communication stream: its collective, then what
/// follows it there (the fused norm, the un-reorder copy), whose rates are
/// already those beside the GEMM.
#[derive(Debug, Clone, Copy)]
pub(super) struct StreamWork {
    pub(super) collective_us: f64,
    pub(super) then_us: f64,
}

impl StreamWork {
    pub(super) fn total_us(&self) -> f64 {
        self.collective_us + self.then_us
    }
}

/// A collective that shares the GPU with the running GEMM goes `slowdown`
/// times slower until the GEMM ends (`gemm_end_us`), then at its own speed.
/// A group's end never decreases as its start or its work grows, which
/// keeps the boundary search exact.
#[derive(Debug, Clone, Copy)]
pub(super) struct Beside {
    gemm_end_us: f64,
    slowdown: f64,
}

impl Beside {
    pub(super) fn new(gemm_end_us: f64, slowdown: f64) -> Self {
        Self {
            gemm_end_us,
            slowdown,
        }
    }

    /// When `work` started at `start_us` ends.
    pub(super) fn end_us(&self, start_us: f64, work: StreamWork) -> f64 {
        let comm_us = work.collective_us;
        let collective_end = if self.slowdown == 1.0 || start_us >= self.gemm_end_us {
            start_us + comm_us
        } else {
            // The collective's own time's worth done while the GEMM still runs.
            let beside_us = (self.gemm_end_us - start_us) / self.slowdown;
            if comm_us <= beside_us {
                start_us + comm_us * self.slowdown
            } else {
                self.gemm_end_us + (comm_us - beside_us)
            }
        };
        collective_end + work.then_us
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn work(collective_us: f64, then_us: f64) -> StreamWork {
        StreamWork {
            collective_us,
            then_us,
        }
    }

    #[test]
    fn a_collective_is_slowed_only_while_the_gemm_runs() {
        let beside = Beside::new(100.0, 1.5);
        // Wholly beside the GEMM: 1.5 times its own time, then what follows.
        assert_eq!(beside.end_us(10.0, work(20.0, 4.0)), 10.0 + 30.0 + 4.0);
        // After the GEMM: its own time.
        assert_eq!(beside.end_us(100.0, work(20.0, 4.0)), 124.0);
        assert_eq!(beside.end_us(150.0, work(20.0, 0.0)), 170.0);
        // Straddling: 30 us beside the GEMM do 20 us of its work, 10 are left after.
        assert_eq!(beside.end_us(70.0, work(30.0, 0.0)), 110.0);
        // No slowdown: the plain sum.
        let none = Beside::new(100.0, 1.0);
        assert_eq!(none.end_us(70.0, work(30.0, 4.0)), 104.0);
    }

    #[test]
    fn a_later_start_or_more_work_never_ends_earlier() {
        let beside = Beside::new(100.0, 1.3);
        let mut previous = 0.0;
        for step in 0..400 {
            let end = beside.end_us(f64::from(step) * 0.5, work(25.0, 3.0));
            assert!(end >= previous, "start {}", f64::from(step) * 0.5);
            previous = end;
        }
        let mut previous = 0.0;
        for step in 0..400 {
            let end = beside.end_us(60.0, work(f64::from(step) * 0.5, 3.0));
            assert!(end >= previous, "work {}", f64::from(step) * 0.5);
            previous = end;
        }
    }
}
