// One streamed generation shown in one panel: SSE parsing, tokens marked by provenance, live figures and
// the acceptance-by-position chart. Terms as in the server's README: a token is an accepted draft token,
// or the target's own token (recovered after a rejection, bonus after a fully accepted block, plain on a
// step without drafts). Each chunk's choice carries "provenance": one object per token with its source,
// step, the drafts its step verified, and the code points [offset, offset + length) of the text it wrote.
"use strict";

const SOURCE_TEXT = {
  accepted: "accepted draft token",
  recovered: "target's token after a rejection (recovered)",
  bonus: "target's token after a fully accepted block (bonus)",
  plain: "target's token, step without drafts (plain)",
};

// Reads an SSE response body; calls onEvent(object) for each "data:" line until [DONE].
async function readEvents(response, onEvent) {
  const reader = response.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  for (;;) {
    const { value, done } = await reader.read();
    if (done) return;
    buffer += decoder.decode(value, { stream: true });
    let cut;
    while ((cut = buffer.indexOf("\n\n")) >= 0) {
      const event = buffer.slice(0, cut);
      buffer = buffer.slice(cut + 2);
      for (const line of event.split("\n")) {
        if (!line.startsWith("data: ")) continue;
        const data = line.slice(6);
        if (data === "[DONE]") return;
        onEvent(JSON.parse(data));
      }
    }
  }
}

function drafterClass(drafter) {
  if (!drafter) return "draft";
  if (drafter.startsWith("ngram")) return "ngram";
  if (drafter.startsWith("suffix")) return "suffix";
  if (drafter === "forced") return "forced";  // the only tokens a grammar allowed: drafted at no cost
  return "draft";
}

class Run {
  constructor(panel) {
    this.panel = panel;
    this.reset();
  }

  reset() {
    this.chars = [];     // the text so far, one entry per code point
    this.owner = [];     // code point -> index into this.tokens
    this.tokens = [];    // provenance objects, in order
    this.rendered = 0;   // code points already in the DOM
    this.steps = new Map();  // step -> {proposed, accepted}
    this.final = null;   // the server's "speculative" figures, once finished
    this.t0 = performance.now();
    this.tFirst = null;  // when the first chunk with tokens arrived
    this.nFirst = 0;     // tokens in that chunk (the prefill's, not decoding)
    this.tLast = null;
    this.panel.querySelector(".text").replaceChildren();
    this.setState("running");
    this.show();
  }

  setState(state, note) {
    this.state = state;
    this.panel.dataset.state = state;
    this.panel.querySelector(".state").textContent = note || state;
  }

  // One chunk's choice: text (chat delta or completion text) and the tokens' provenance.
  onChoice(choice) {
    const now = performance.now();
    const prov = choice.provenance || [];
    if (prov.length) {
      if (this.tFirst === null) { this.tFirst = now; this.nFirst = prov.length; }
      this.tLast = now;
    }
    for (const p of prov) {
      const index = this.tokens.push(p) - 1;
      for (let c = p.offset; c < p.offset + p.length; c++) this.owner[c] = index;
      let s = this.steps.get(p.step);
      if (!s) this.steps.set(p.step, (s = { proposed: p.proposed, accepted: 0 }));
      if (p.source === "accepted") s.accepted += 1;
    }
    const text = choice.delta ? choice.delta.content : choice.text;
    if (text) this.chars.push(...Array.from(text));
    this.render();
    this.show();
  }

  onFinal(speculative) {
    this.final = speculative;
    this.show();
  }

  // Appends the code points not yet shown, one span per token (a token's characters stay together).
  render() {
    const box = this.panel.querySelector(".text");
    const created = [];
    let span = box.lastChild, owner = span ? span.tokenIndex : undefined;
    for (let c = this.rendered; c < this.chars.length; c++) {
      if (span === null || this.owner[c] !== owner) {
        owner = this.owner[c];
        span = this.tokenSpan(owner);
        created.push(span);
        box.appendChild(span);
      }
      span.textContent += this.chars[c];
    }
    this.rendered = this.chars.length;
    if (created.length) setTimeout(() => created.forEach((s) => s.classList.remove("new")), 400);
  }

  tokenSpan(index) {
    const span = document.createElement("span");
    span.tokenIndex = index;
    const p = this.tokens[index];
    if (p === undefined) return span;  // characters no token wrote (a flushed partial character)
    span.className = `tok ${p.source}${p.source === "accepted" ? " " + drafterClass(p.drafter) : ""}` +
      `${p.step % 2 ? " odd" : ""} new`;
    span.dataset.source = p.source;
    span.dataset.step = p.step;
    span.title = `${SOURCE_TEXT[p.source]}${p.drafter ? ` (${p.drafter})` : ""}\n` +
      `step ${p.step}, ${p.proposed} draft${p.proposed === 1 ? "" : "s"} verified, token id ${p.token_id}`;
    return span;
  }

  // Live figures from the provenance; the server's exact ones once the last chunk arrived.
  figures() {
    let proposed = 0, accepted = 0;
    const byPos = [];
    for (const s of this.steps.values()) {
      proposed += s.proposed;
      accepted += s.accepted;
      for (let j = 0; j < s.proposed; j++) {
        byPos[j] = byPos[j] || { proposed: 0, accepted: 0 };
        byPos[j].proposed += 1;
        if (j < s.accepted) byPos[j].accepted += 1;
      }
    }
    const n = this.tokens.length;
    const decodeSeconds = this.tLast !== null ? (this.tLast - this.tFirst) / 1000 : 0;
    const f = {
      tokens: n,
      tps: decodeSeconds > 0 ? (n - this.nFirst) / decodeSeconds : null,
      ttft: this.tFirst !== null ? (this.tFirst - this.t0) / 1000 : null,
      mal: this.steps.size ? n / this.steps.size : null,
      rate: proposed ? accepted / proposed : null,
      byPos,
    };
    if (this.final) {
      f.mal = this.final.mean_accepted_length;
      f.rate = this.final.acceptance_rate;
    }
    return f;
  }

  show() {
    const f = this.figures();
    const put = (cls, v) => { this.panel.querySelector("." + cls).textContent = v; };
    put("tps", f.tps === null ? "–" : f.tps.toFixed(1));
    put("ttft", f.ttft === null ? "–" : `${f.ttft.toFixed(2)} s`);
    put("ntok", String(f.tokens));
    put("mal", f.mal === null || f.mal === undefined ? "–" : f.mal.toFixed(2));
    put("rate", f.rate === null || f.rate === undefined ? "–" : `${(100 * f.rate).toFixed(1)}%`);
    drawChart(this.panel.querySelector(".chart"), f.byPos);
  }

  text() {
    return this.chars.join("");
  }
}

// Bars: acceptance rate at draft position 1..k (accepted / proposed there), with the counts proposed.
function drawChart(canvas, byPos) {
  const ratio = window.devicePixelRatio || 1;
  const w = canvas.clientWidth || canvas.width, h = canvas.clientHeight || canvas.height;
  if (canvas.width !== Math.round(w * ratio)) { canvas.width = Math.round(w * ratio); canvas.height = Math.round(h * ratio); }
  const g = canvas.getContext("2d");
  g.setTransform(ratio, 0, 0, ratio, 0, 0);
  g.clearRect(0, 0, w, h);
  const css = getComputedStyle(canvas);
  const ink = css.getPropertyValue("--ink") || "#222", bar = css.getPropertyValue("--accepted") || "#3a3";
  const left = 30, bottom = h - 16, top = 14, right = w - 6;
  g.font = "10px sans-serif";
  g.fillStyle = ink;
  g.strokeStyle = ink;
  g.globalAlpha = 0.35;
  g.beginPath();
  for (const y of [0, 0.5, 1]) {
    const py = bottom - y * (bottom - top);
    g.moveTo(left, py); g.lineTo(right, py);
  }
  g.stroke();
  g.globalAlpha = 1;
  g.textAlign = "right";
  g.textBaseline = "middle";
  for (const y of [0, 0.5, 1]) g.fillText(`${y * 100}%`, left - 3, bottom - y * (bottom - top));
  g.textAlign = "left";
  g.textBaseline = "top";
  g.fillText("acceptance by draft position", left + 2, 0);
  if (!byPos.length) return;
  const slot = (right - left) / byPos.length, bw = Math.max(2, slot * 0.7);
  g.textAlign = "center";
  byPos.forEach((pos, j) => {
    const rate = pos.accepted / pos.proposed;
    const x = left + j * slot + (slot - bw) / 2;
    g.globalAlpha = 0.35;  // the frame of a position that had drafts, so that 0% shows too
    g.strokeRect(x + 0.5, top + 0.5, bw - 1, bottom - top - 1);
    g.globalAlpha = 1;
    g.fillStyle = bar;
    g.fillRect(x, bottom - rate * (bottom - top), bw, rate * (bottom - top));
    g.fillStyle = ink;
    if (slot >= 14 || j % Math.ceil(14 / slot) === 0) g.fillText(String(j + 1), x + bw / 2, bottom + 3);
  });
}
