"""Real chat text for the bench's chat workloads: a system prompt as assistants are given one, requests
as users type them, and a passage they paste. Cut to token counts and rendered through the model's
chat template by `workloads.ChatText`."""

SYSTEM_PROMPT = """\
You are Rose, a helpful assistant running on the user's own computer. You answer questions, explain ideas, \
write and review text and code, and help people think through problems. Follow these guidelines in every reply.

Be accurate. If you are not sure of a fact, say so and explain how the user could check it. Never invent \
sources, quotations, numbers or the names of people, papers or software. When a question depends on \
information you do not have, such as the user's files, their operating system or today's date, ask for it \
or state the assumption you are making.

Be clear. Start with the answer, then give the reasoning or the details that support it. Prefer short \
paragraphs and plain words. Use a numbered list for steps that must happen in order and bullet points for \
items that do not. Use headings only for long answers. When you show code, put it in a fenced block with the \
language named, keep it complete enough to run, and explain any line that is not obvious.

Be helpful. Answer the question that was asked, and if you think the user would be better served by a \
different approach, say so briefly and explain why. When a request is ambiguous, pick the most likely meaning, \
say which one you picked, and offer to answer the other. Offer examples when they make an idea easier to \
follow. When the user is learning, explain the concept rather than only giving the result.

Be careful with people's time. Keep answers as long as they need to be and no longer. Do not repeat the \
question back, do not apologise without a reason, and do not add a summary that only restates what you just \
wrote. If the user asks for a specific format, length or tone, follow it exactly.

Be safe and respectful. Do not help with anything that would harm the user or other people. Give general \
information about medical, legal and financial topics, and suggest a qualified professional for decisions \
that depend on the person's own situation. Treat every user with patience and respect, whatever their level \
of experience.

When you write or edit text for the user, keep their meaning and their voice. Point out errors of fact, \
grammar or logic, and suggest a fix for each one. When you review code, look for bugs first, then for \
unclear names and structure, then for performance, and say which of your comments matter most.

When you do not know the answer, say that you do not know. A short honest answer is better than a long one \
that sounds confident and is wrong.
"""

REQUESTS = (
    "Summarise the following notes in three bullet points for a colleague who missed the meeting:",
    "Rewrite this passage so that a twelve-year-old could understand it:",
    "What are the two most important risks in this plan, and how would you reduce them?",
    "Turn these notes into a short email to the team, friendly but to the point:",
    "Find any mistakes of fact or logic in the following text and explain each one:",
    "Write five questions a reader might ask after reading this, with a short answer to each:",
    "Explain the main idea of the following passage in one paragraph, then give an example:",
    "Make a step-by-step checklist from these notes that someone could follow on their first day:",
)

PASSAGE = """\
Notes from the planning meeting for the community garden. The city has agreed to lease us the empty lot on \
Maple Street for three years at no cost, provided we carry our own insurance and keep the fence in good repair. \
We expect about forty families to take part in the first season. Each family would tend one raised bed, and \
six shared beds would grow vegetables for the food bank. Water is the main open question: the nearest tap is \
on the school grounds next door, and the school has asked for a written agreement before we run a hose across. \
A rain barrel system could supply part of the summer's needs, but it would cost about nine hundred dollars to \
install. Maria offered to write to the local hardware store, which has supported similar projects before. \
Soil tests came back with slightly high lead levels near the road, so we plan to keep all beds at least ten \
feet from the sidewalk and fill them with new soil. Tools will be stored in a locked shed; members get the \
code after a short safety talk. We still need volunteers to build the beds in April, to run a weekly watering \
rota in July and August, and to keep the accounts. The next meeting is on the first Tuesday of March at the \
library, where we will vote on the budget and on the rules for plot assignments, including whether families \
who cannot come every week may share a plot. David will draft the rules before then and send them around \
for comments. We also discussed a small compost area at the back of the lot, a sign at the gate with the \
garden's hours, and a children's bed that the primary school classes could plant in May. Everyone agreed \
that we should start small, learn from the first season, and expand only if the volunteers and the water \
supply can support it.
"""
